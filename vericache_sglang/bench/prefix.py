"""Remote prefix caching: one shared document whose full KV is in the store, requests that reuse it.

Fetch-then-decode moves the document's full KV over the slow link, prefills the request's own
tokens over it and decodes with the full KV. VeriCache drafts at once over the document's
compressed KV (kept next to the prefix index; its one-time shipment over the slow link is reported
apart) and verifies next to the store, over the fast link. Time to first token and throughput
for both, every output checked against fetch-then-decode token by token. Writes ``prefix.json``,
``prefix.md`` and a PNG plot.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch

from remote_store.backends.memory import MemoryStore
from remote_store.link import LinkEmulator
from vericache_sglang.bench.common import PROMPTS, load_config, table
from vericache_sglang.core.compress import parse_spec
from vericache_sglang.engine.decode import generate_full, generate_vericache_from_prefix
from vericache_sglang.engine.engine import Engine, compare
from vericache_sglang.engine.hardware import Bandwidth, streaming_read_bandwidth
from vericache_sglang.engine.prefill import prefill
from vericache_sglang.engine.prefix import PrefixRegistry
from vericache_sglang.full_kv.store import FullKVStore


def document_text(name: str) -> str:
    text = (PROMPTS / f"{name}.txt").read_text()
    return text.rsplit("\n\n", 1)[0]  # the document without the prompt file's closing instruction


def common_prefix(seqs: list[list[int]]) -> list[int]:
    n = min(len(s) for s in seqs)
    i = next((i for i in range(n) if len({s[i] for s in seqs}) > 1), n)
    return seqs[0][:i]


def run(config_path: Path | None = None, quick: bool = False, out_dir: Path | None = None, log=print) -> dict:
    cfg = load_config("prefix", config_path, quick)
    specs = cfg.get("compressors", [cfg["compressor"]])
    if specs[0] != cfg["compressor"]:
        raise ValueError(f"compressors {specs}: the first is the summary's, so must be {cfg['compressor']}")
    torch.set_num_threads(cfg["threads"])
    engine = Engine(cfg["model"])
    runner, tok = engine.runner, engine.tokenizer
    doc = document_text(cfg["document"])
    questions = [cfg["questions"][i % len(cfg["questions"])] for i in range(cfg["requests"])]
    prompts = [engine.encode(f"{doc}\n\nQuestion: {q}") for q in questions]
    shared = common_prefix(prompts) if len(prompts) > 1 else prompts[0][:-8]
    probe = streaming_read_bandwidth(str(runner.device))
    log(f"memory bandwidth: {probe.describe()}")
    mem_bw = probe.bytes_s
    backend, ns = MemoryStore(), uuid.uuid4().hex
    slow_link = LinkEmulator(backend, mem_bw / cfg["slow_link_ratio"], ratio=cfg["slow_link_ratio"])
    fast_link = LinkEmulator(backend, mem_bw / cfg["fast_link_ratio"], ratio=cfg["fast_link_ratio"])
    views = [
        FullKVStore(b, runner.layout, namespace=ns, chunk_tokens=cfg["chunk_tokens"])
        for b in (backend, slow_link, fast_link)
    ]
    local, slow, fast = views
    # Several compressors side by side in one run (the first is the summary's): each registers the
    # document once; fetch-then-decode runs once per request.
    prefixes = {}
    for spec in specs:
        prefixes[spec] = prefix = PrefixRegistry(runner, local, parse_spec(spec)).register(shared)
        log(
            f"document: {len(prefix.tokens)} tokens registered in {prefix.seconds:.1f} s (full KV "
            f"{prefix.full_kv_bytes / 2**20:.1f} MiB, `{spec}` {prefix.compressed_kv_bytes / 2**20:.1f} MiB)"
        )
    gen = engine.config(max_new_tokens=cfg["new_tokens"], horizon=cfg["horizon"], keep_logits=True)
    rows = []
    for i, prompt in enumerate(prompts):
        t0 = time.monotonic()
        full_prefix = slow.load_prefix(prompt, len(prefix.tokens))
        fetch_s = time.monotonic() - t0
        pre = prefill(runner, prompt, prefix=full_prefix)
        ttft_s = time.monotonic() - t0  # the first token is drawn from the prefill's logits
        ref = generate_full(runner, pre, gen, tok)
        baseline = FetchThenDecode(fetch_s, ttft_s, time.monotonic() - t0)
        for spec, prefix in prefixes.items():
            rows.append(_vericache_row(runner, prefix, spec, prompt, fast, fast_link, gen, tok, ref, i, baseline))
            r = rows[-1]
            log(
                f"request {i}: TTFT {baseline.ttft_s:.2f} s -> {r['vericache_ttft_s']:.2f} s, total "
                f"{baseline.total_s:.1f} s -> {r['vericache_total_s']:.1f} s, `{spec}` identical={r['identical']}"
            )
    summary = _summary(cfg, [r for r in rows if r["compressor"] == specs[0]], prefixes[specs[0]], probe)
    if len(prefixes) > 1:
        summary["identical"] = all(r["identical"] for r in rows)
        summary["by_compressor"] = {}
        for spec in prefixes:
            mine = [r for r in rows if r["compressor"] == spec]
            summary["by_compressor"][spec] = {
                "throughput_tok_s": sum(r["tokens"] for r in mine) / sum(r["vericache_total_s"] for r in mine),
                "ttft_s": sum(r["vericache_ttft_s"] for r in mine) / len(mine),
                "mean_accepted_length": sum(r["mean_accepted_length"] for r in mine) / len(mine),
            }
    if out_dir is not None:
        _write(out_dir, cfg, rows, summary, quick)
    return summary


@dataclass(frozen=True)
class FetchThenDecode:
    """The baseline's timings for one request: fetch the whole prefix's full KV, then decode."""

    fetch_s: float
    ttft_s: float
    total_s: float


def _vericache_row(
    runner,
    prefix,
    spec: str,
    prompt: list[int],
    fast: FullKVStore,
    fast_link: LinkEmulator,
    gen,
    tok,
    ref,
    i: int,
    baseline: FetchThenDecode,
) -> dict:
    """One request by VeriCache over ``prefix`` (compressed by ``spec``), against fetch-then-decode's."""
    transfer_before = fast_link.transfer_s
    t1 = time.monotonic()
    res, req = generate_vericache_from_prefix(runner, prefix, prompt, prefix.compressor, fast, gen, tok)
    total_vc = time.monotonic() - t1
    cmp = compare(ref, res)
    return {
        "request": i,
        "compressor": spec,
        "prompt_tokens": len(prompt),
        "prefix_tokens": len(prefix.tokens),
        "fetch_then_decode_ttft_s": baseline.ttft_s,
        "fetch_then_decode_fetch_s": baseline.fetch_s,
        "fetch_then_decode_total_s": baseline.total_s,
        "vericache_ttft_s": req.first_token_s,
        "vericache_total_s": total_vc,
        "tokens": len(res.tokens),
        "identical": cmp["identical"],
        "max_logit_abs_diff": cmp["max_logit_abs_diff"],
        "mean_accepted_length": res.stats.mean_accepted_length,
        "verify_transfer_s": fast_link.transfer_s - transfer_before,
        "verify_wait_s": res.stats.fetch_wait_s,
    }


def _summary(cfg: dict, rows: list[dict], prefix, probe: Bandwidth) -> dict:
    mem_bw = probe.bytes_s
    tokens = sum(r["tokens"] for r in rows)
    mean = lambda key: sum(r[key] for r in rows) / len(rows)
    transfer = sum(r["verify_transfer_s"] for r in rows)
    return {
        "identical": all(r["identical"] for r in rows),
        "ttft_s": {
            "fetch_then_decode": round(mean("fetch_then_decode_ttft_s"), 4),
            "vericache": round(mean("vericache_ttft_s"), 4),
        },
        "throughput_tok_s": {
            "fetch_then_decode": round(tokens / sum(r["fetch_then_decode_total_s"] for r in rows), 3),
            "vericache": round(tokens / sum(r["vericache_total_s"] for r in rows), 3),
        },
        "hidden_transfer_fraction": (1 - sum(r["verify_wait_s"] for r in rows) / transfer) if transfer else None,
        "compressed_prefix_shipment_s": prefix.compressed_kv_bytes / (mem_bw / cfg["slow_link_ratio"]),
        "prefix_tokens": len(prefix.tokens),
        "full_prefix_bytes": prefix.full_kv_bytes,
        "compressed_prefix_bytes": prefix.compressed_kv_bytes,
        "slow_link_ratio": cfg["slow_link_ratio"],
        "fast_link_ratio": cfg["fast_link_ratio"],
        "memory_bytes_s": mem_bw,
        "compressor": cfg["compressor"],
        "horizon": cfg["horizon"],
        "requests": cfg["requests"],
        "new_tokens": cfg["new_tokens"],
        "memory_probe": probe.to_dict(),
        "memory_probe_text": probe.describe(),
    }


def _write(out_dir: Path, cfg: dict, rows: list[dict], summary: dict, quick: bool) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = cfg.get("stem", "prefix") + ("_quick" if quick else "")
    (out_dir / f"{stem}.json").write_text(json.dumps({"config": cfg, "rows": rows, "summary": summary}, indent=2))
    specs = list(dict.fromkeys(r["compressor"] for r in rows))
    cols = (
        ["request"]
        + (["compressor"] if len(specs) > 1 else [])
        + [
            "prompt_tokens",
            "fetch_then_decode_ttft_s",
            "vericache_ttft_s",
            "fetch_then_decode_total_s",
            "vericache_total_s",
            "tokens",
            "identical",
            "mean_accepted_length",
        ]
    )
    md = [
        f"Remote prefix caching: a {summary['prefix_tokens']}-token document, {cfg['requests']} requests x "
        f"{cfg['new_tokens']} new tokens, `{cfg['compressor']}`, x={cfg['horizon']}; slow link at ratio "
        f"{cfg['slow_link_ratio']}, verification on a link at ratio {cfg['fast_link_ratio']} of "
        f"memory: {summary['memory_probe_text']}. One-time shipment of the "
        f"compressed document over the slow link: {summary['compressed_prefix_shipment_s']:.2f} s "
        "(not in the per-request times).",
        "",
        table(rows, cols),
        "",
        f"Mean TTFT: fetch-then-decode {summary['ttft_s']['fetch_then_decode']:.2f} s, VeriCache "
        f"{summary['ttft_s']['vericache']:.2f} s. Throughput: {summary['throughput_tok_s']['fetch_then_decode']:.2f} "
        f"vs {summary['throughput_tok_s']['vericache']:.2f} tok/s (`{specs[0]}`).",
    ]
    for spec, by in summary.get("by_compressor", {}).items():
        md.append(
            f"- `{spec}`: {by['throughput_tok_s']:.2f} tok/s, mean TTFT {by['ttft_s']:.2f} s, accepted length "
            f"{by['mean_accepted_length']:.2f}"
        )
    (out_dir / f"{stem}.md").write_text("\n".join(md) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    width = 0.8 / (1 + len(specs))
    for ax, key, label in ((axes[0], "ttft_s", "time to first token (s)"), (axes[1], "total_s", "request time (s)")):
        first = [r for r in rows if r["compressor"] == specs[0]]
        ax.bar(
            [r["request"] - 0.4 + width / 2 for r in first],
            [r[f"fetch_then_decode_{key}"] for r in first],
            width,
            label="fetch-then-decode",
        )
        for k, spec in enumerate(specs, 1):
            mine = [r for r in rows if r["compressor"] == spec]
            ax.bar(
                [r["request"] - 0.4 + width * (k + 0.5) for r in mine],
                [r[f"vericache_{key}"] for r in mine],
                width,
                label=f"VeriCache {spec[:40]}" if len(specs) > 1 else "VeriCache",
            )
        ax.set_xlabel("request")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3, axis="y")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_dir / f"{stem}.png", dpi=120)
    plt.close(fig)
