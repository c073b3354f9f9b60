"""Long-context decoding: full KV resident, full KV offloaded and fetched every step, lossy,
VeriCache lock-step, VeriCache staggered, on the same runner, requests, budget and link.

Parameters come from a config file fixed before measuring (``benchmarks/configs/longctx.json``).
Budgets are in units of one request's full KV; links are emulated at a ratio of this machine's
measured memory bandwidth. Every VeriCache and offloaded output is checked token by token against
full-KV decoding. Writes ``longctx.json``, ``longctx.md`` and PNG plots.
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

import torch

from remote_store.backends.memory import MemoryStore
from remote_store.link import LinkEmulator
from vericache_sglang.bench.common import load_config, plot_lines, prompts_for, table
from vericache_sglang.core.compress import parse_spec
from vericache_sglang.engine.batch import BatchEngine
from vericache_sglang.engine.batch_jobs import BatchConfig
from vericache_sglang.engine.engine import Engine, compare
from vericache_sglang.engine.hardware import Bandwidth, streaming_read_bandwidth
from vericache_sglang.full_kv.store import FullKVStore

MODES = {
    "full_resident": ("full_resident", "staggered"),
    "full_offloaded": ("full_offloaded", "staggered"),
    "lossy": ("lossy", "staggered"),
    "vericache_lockstep": ("vericache", "lockstep"),
    "vericache_staggered": ("vericache", "staggered"),
}
EXACT_MODES = ("full_offloaded", "vericache_lockstep", "vericache_staggered")


def run(config_path: Path | None = None, quick: bool = False, out_dir: Path | None = None, log=print) -> dict:
    cfg = load_config("longctx", config_path, quick)
    modes = cfg.get("modes", list(MODES))  # the reference first; staggered is what the summary reads
    if not modes or modes[0] != "full_resident" or "vericache_staggered" not in modes or not set(modes) <= set(MODES):
        raise ValueError(f"modes {modes}: full_resident first, vericache_staggered among them, of {list(MODES)}")
    # Several compressors side by side in one run (the first is the summary's); modes that read no
    # compressed KV run once.
    specs = cfg.get("compressors", [cfg["compressor"]])
    if specs[0] != cfg["compressor"]:
        raise ValueError(f"compressors {specs}: the first is the summary's, so must be {cfg['compressor']}")
    torch.set_num_threads(cfg["threads"])
    engine = Engine(cfg["model"])
    runner = engine.runner
    gen = engine.config(max_new_tokens=cfg["new_tokens"], horizon=cfg["horizon"], keep_logits=True)
    prompts = prompts_for(engine, cfg["prompts"], cfg["requests"])
    t = time.monotonic()
    pres = [engine.prefill(p, reuse_prefix=False) for p in prompts]
    log(f"prefilled {len(pres)} requests ({sum(len(p.tokens) for p in pres)} tokens) in {time.monotonic() - t:.1f} s")
    probe = streaming_read_bandwidth(str(runner.device))
    log(f"memory bandwidth: {probe.describe()}")
    mem_bw = probe.bytes_s
    unit = max((len(p.tokens) + cfg["new_tokens"]) * runner.layout.bytes_per_token for p in pres)
    points = sorted(
        {(b, cfg["default_link_ratio"]) for b in cfg["budgets_full_kv"]}
        | {(cfg["default_budget_full_kv"], r) for r in cfg["link_ratios"]}
    )
    rows, reference = [], None
    for budget_units, ratio in points:
        budget = int(budget_units * unit)
        for name, spec in [
            (m, s) for m in modes for s in (specs if MODES[m][0] in ("lossy", "vericache") else specs[:1])
        ]:
            mode, schedule = MODES[name]
            link = LinkEmulator(MemoryStore(), mem_bw / ratio, ratio=ratio)
            store = FullKVStore(link, runner.layout, namespace=uuid.uuid4().hex, chunk_tokens=cfg["chunk_tokens"])
            batch = BatchEngine(
                runner,
                store,
                parse_spec(spec),
                BatchConfig(mode=mode, schedule=schedule, kv_budget_bytes=budget, window=cfg["window"]),
                gen,
                engine.tokenizer,
            )
            for i, pre in enumerate(pres):
                batch.submit(pre, f"r{i}")
            log(f"budget {budget_units}x ratio {ratio:>4}: {name} running ...")
            results = batch.run()
            outputs = [results[f"r{i}"] for i in range(len(pres))]
            if reference is None and name == "full_resident":
                reference = outputs
            cmps = [compare(ref, out) for ref, out in zip(reference, outputs, strict=True)]
            st = batch.stats
            row = {
                "mode": name,
                "compressor": spec,
                "budget_full_kv": budget_units,
                "budget_bytes": budget,
                "link_ratio": ratio,
                "series": name if len(specs) == 1 or mode not in ("lossy", "vericache") else f"{name} {spec}",
                "link_bytes_s": mem_bw / ratio,
                "memory_bytes_s": mem_bw,
                "throughput_tok_s": st.throughput_tok_s,
                "generated_tokens": st.generated_tokens,
                "wall_s": st.wall_s,
                "iterations": st.iterations,
                "peak_running": st.peak_running,
                "verify_passes": st.verify_passes,
                "fetched_bytes": st.fetched_bytes,
                "transfer_s": st.transfer_s,
                "stall_s": st.stall_s,
                "hidden_transfer_fraction": st.hidden_transfer_fraction if st.transfer_s else None,
                "waiting_iterations": st.waiting_iterations,
                "rows": st.rows,
                "gflop": runner.flops(st.rows, st.attended_keys) / 1e9,
                "identical": all(c["identical"] for c in cmps),
                "max_logit_abs_diff": max((c["max_logit_abs_diff"] or 0.0) for c in cmps),
                "mean_accepted_length": _mean([o.stats.mean_accepted_length for o in outputs if o.stats.committed]),
            }
            rows.append(row)
            log(
                f"budget {budget_units}x ratio {ratio:>4}: {name:<20} {row['throughput_tok_s']:7.2f} tok/s "
                f"{spec if len(specs) > 1 and mode in ('lossy', 'vericache') else ''} "
                f"running<= {row['peak_running']} identical={row['identical']} "
                f"hidden={_fmt(row['hidden_transfer_fraction'])}"
            )
    _add_bounds(rows)
    summary = _summary(cfg, rows, probe)
    if out_dir is not None:
        _write(out_dir, cfg, rows, summary, quick)
    return summary


def _add_bounds(rows: list[dict]) -> None:
    """What each run's cost was, and two ceilings on VeriCache at its point, from the same run:
    ``link_bound_tok_s`` if the link moved its fetched bytes back to back with nothing else in the
    way, ``compute_bound_tok_s`` if its arithmetic (drafts, and verifies attending to the full KV)
    ran at the best rate a full-KV or lossy batch reached at that point. Where resident decoding
    beats the lower of the two, no schedule of these verifications can reach it."""
    for r in rows:
        r["ms_per_iteration"] = 1000 * r["wall_s"] / r["iterations"] if r["iterations"] else None
        r["tokens_per_iteration"] = r["generated_tokens"] / r["iterations"] if r["iterations"] else None
        r["rows_per_token"] = r["rows"] / r["generated_tokens"] if r["generated_tokens"] else None
        r["gflop_per_token"] = r["gflop"] / r["generated_tokens"] if r["generated_tokens"] else None
        r["gflop_s"] = r["gflop"] / r["wall_s"] if r["wall_s"] else None
    for r in rows:
        peers = [p for p in rows if (p["budget_full_kv"], p["link_ratio"]) == (r["budget_full_kv"], r["link_ratio"])]
        r["resident_tok_s"] = next((p["throughput_tok_s"] for p in peers if p["mode"] == "full_resident"), None)
        if not r["mode"].startswith("vericache"):
            continue
        r["link_bound_tok_s"] = (
            r["generated_tokens"] * r["link_bytes_s"] / r["fetched_bytes"] if r["fetched_bytes"] else None
        )
        best_rate = max((p["gflop_s"] or 0.0 for p in peers if not p["mode"].startswith("vericache")), default=0.0)
        r["compute_bound_tok_s"] = r["generated_tokens"] * best_rate / r["gflop"] if best_rate and r["gflop"] else None
        bounds = [b for b in (r["link_bound_tok_s"], r["compute_bound_tok_s"]) if b]
        r["of_bound"] = r["throughput_tok_s"] / min(bounds) if bounds else None


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _summary(cfg: dict, rows: list[dict], probe: Bandwidth) -> dict:
    default = [
        r
        for r in rows
        if r["budget_full_kv"] == cfg["default_budget_full_kv"]
        and r["link_ratio"] == cfg["default_link_ratio"]
        and r["compressor"] == cfg["compressor"]
    ]
    by_mode = {r["mode"]: r for r in default}
    staggered = by_mode["vericache_staggered"]
    return {
        "identical": all(r["identical"] for r in rows if r["mode"] in EXACT_MODES),
        "throughput_tok_s": {m: round(r["throughput_tok_s"], 3) for m, r in by_mode.items()},
        "hidden_transfer_fraction": staggered["hidden_transfer_fraction"],
        "budget_full_kv": cfg["default_budget_full_kv"],
        "link_ratio": cfg["default_link_ratio"],
        "link_bytes_s": staggered["link_bytes_s"],
        "memory_bytes_s": staggered["memory_bytes_s"],
        "compressor": cfg["compressor"],
        "horizon": cfg["horizon"],
        "requests": cfg["requests"],
        "new_tokens": cfg["new_tokens"],
        "memory_probe": probe.to_dict(),
        "memory_probe_text": probe.describe(),
    }


def _write(out_dir: Path, cfg: dict, rows: list[dict], summary: dict, quick: bool) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = cfg.get("stem", "longctx") + ("_quick" if quick else "")
    (out_dir / f"{stem}.json").write_text(json.dumps({"config": cfg, "rows": rows, "summary": summary}, indent=2))
    several = len(cfg.get("compressors", [])) > 1
    cols = (
        ["mode"]
        + (["compressor"] if several else [])
        + [
            "budget_full_kv",
            "link_ratio",
            "throughput_tok_s",
            "peak_running",
            "identical",
            "mean_accepted_length",
            "hidden_transfer_fraction",
            "stall_s",
            "transfer_s",
            "wall_s",
        ]
    )
    md = [
        f"Long-context decoding, {cfg['requests']} requests x {cfg['new_tokens']} new tokens, "
        + (", ".join(f"`{c}`" for c in cfg["compressors"]) if several else f"`{cfg['compressor']}`")
        + f", x={cfg['horizon']}; budgets in full-KV units "
        f"({rows[0]['budget_bytes'] / rows[0]['budget_full_kv'] / 2**20:.0f} MiB each); memory "
        f"{summary['memory_probe_text']}, links at the ratios shown against its median.",
        "",
        table(rows, cols),
        "",
        "Where the time went, and VeriCache's ceilings at each point from the same run: `gflop_per_token` "
        "counts every row's matmuls and its attention over the keys it read; `link_bound_tok_s` if the link "
        "moved the fetched bytes back to back, `compute_bound_tok_s` if VeriCache's arithmetic ran at the "
        "best `gflop_s` a full-KV or lossy batch reached at that point; `of_bound` = throughput / the lower "
        "of the two.",
        "",
        table(
            rows,
            ["mode"]
            + (["compressor"] if several else [])
            + [
                "budget_full_kv",
                "link_ratio",
                "throughput_tok_s",
                "resident_tok_s",
                "ms_per_iteration",
                "tokens_per_iteration",
                "rows_per_token",
                "gflop_per_token",
                "gflop_s",
                "link_bound_tok_s",
                "compute_bound_tok_s",
                "of_bound",
            ],
        ),
    ]
    (out_dir / f"{stem}.md").write_text("\n".join(md) + "\n")
    ratio0, budget0 = cfg["default_link_ratio"], cfg["default_budget_full_kv"]
    plot_lines(
        out_dir / f"{stem}_budget.png",
        rows,
        x="budget_full_kv",
        series="series",
        where=lambda r: r["link_ratio"] == ratio0,
        xlabel="device KV budget (full KVs)",
        title=f"Throughput against budget (link ratio {ratio0})",
    )
    plot_lines(
        out_dir / f"{stem}_link.png",
        rows,
        x="link_ratio",
        series="series",
        where=lambda r: r["budget_full_kv"] == budget0,
        xlabel="memory / link bandwidth ratio",
        title=f"Throughput against link ratio (budget {budget0} full KVs)",
        logx=True,
    )
