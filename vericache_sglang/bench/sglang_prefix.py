"""Remote prefix caching across SGLang servers on this CPU (``vericache bench sglang-prefix``;
config ``benchmarks/configs/sglang_prefix.json``, fixed before measuring).

Two servers of one system, A and B, side by side; for each document (a real prompt's document cut
to about ``document_tokens`` tokens, the system message), one question to A, then another to B,
each streamed. B never saw the document. Five systems, one after the other on the same machine,
those with a store once per ``link_ratios`` entry (the store behind a link that many times slower
than this machine's measured memory bandwidth, ``?link_ratio=R``):

- ``stock``: stock SGLang; B prefills the document (its radix tree is its own);
- ``vericache``: ``--enable-vericache`` with ``full_kv: "store"``, both over one fresh gRPC store;
  B loads the document's full KV that A wrote from the store into its radix tree instead of
  prefilling it, then drafts and verifies as usual;
- ``hicache``: stock SGLang with HiCache (``--enable-hierarchical-cache``) over the same kind of
  store through our HiCache storage backend (``vericache_sglang/sglang/storage.py``), SGLang's own
  way of sharing a prefix through L3 storage (on CPU through the platform layer's answers to its
  CUDA assumptions, ``sglang/cpu/hicache.py``); B prefetches the document's pages from the store
  into its host pool and loads them onto the device before it prefills the rest; a system that
  does not launch gets a row saying why;
- ``vericache-hicache``: ``--enable-vericache`` (``full_kv: "device"``) on HiCache, the two over
  the same store: HiCache moves the document's full KV (B prefetches it), VeriCache drafts over a
  compressed copy B makes of it (``draft/hicache_tree.py``);
- ``vericache-store-hicache``: the same with ``full_kv: "store"``: HiCache moves the document, the
  store tier each running request's whole context (the document included), fetched for every
  verification.

Per question: time to first token, tokens/s after it, the prompt tokens SGLang reports cached,
peak device KV (``sglang:num_used_tokens``, polled), what VeriCache's B loaded and fetched from
the store and the share of its fetch time its verify passes did not wait for (hidden behind
drafting; its ``/metrics``), and whether the answer is stock's, text for text. Writes
``sglang_prefix.json`` and ``.md``.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from vericache_sglang.bench.common import load_config, table
from vericache_sglang.bench.sglang_cpu import store_server
from vericache_sglang.bench.sglang_server import SGLangServer, document_prompt, metric_growth, model_dir, peak_tokens
from vericache_sglang.engine.hardware import memory_bandwidth


def _documents(cfg: dict) -> dict[str, str]:
    """Each named prompt's document (its closing question dropped) at about ``document_tokens``."""
    return {name: document_prompt(name, cfg["document_tokens"]).rsplit("\n\n", 1)[0] for name in cfg["documents"]}


def timed_chat(server: SGLangServer, document: str, question: str, max_tokens: int) -> dict:
    """One streamed, greedy chat request: time to first token, decode rate, cached prompt tokens."""
    client = server.client()
    t0 = time.perf_counter()
    first, text, usage = None, "", None
    stream = client.chat.completions.create(
        model="default",
        messages=[{"role": "system", "content": document}, {"role": "user", "content": question}],
        max_tokens=max_tokens,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first = first if first is not None else time.perf_counter() - t0
            text += chunk.choices[0].delta.content
        usage = chunk.usage or usage
    seconds = time.perf_counter() - t0
    details = getattr(usage, "prompt_tokens_details", None)
    tokens = usage.completion_tokens if usage else 0
    return {
        "ttft_s": first,
        "seconds": seconds,
        "decode_tokens_per_s": (tokens - 1) / (seconds - first) if first is not None and tokens > 1 else None,
        "prompt_tokens": usage.prompt_tokens if usage else None,
        "cached_tokens": getattr(details, "cached_tokens", None) or 0,
        "completion_tokens": tokens,
        "_text": text,
    }


def _launch_args(cfg: dict, system: str, store_url: str) -> tuple[list[str], dict | None]:
    args = list(cfg["server_args"])
    if system == "vericache":
        return args, {**cfg["vericache"], "full_kv": "store", "store": store_url}
    if system in HICACHE_SYSTEMS:
        extra = {**cfg["hicache"]["extra_config"], "store_url": store_url}
        args += [*cfg["hicache"]["args"], "--hicache-storage-backend-extra-config", json.dumps(extra)]
        mode = HICACHE_SYSTEMS[system]
        if mode is None:
            return args, None
        return args, {**cfg["vericache"], **mode, **({"store": store_url} if mode["full_kv"] == "store" else {})}
    return args, None


# the systems on HiCache: VeriCache's full_kv on it (None: stock SGLang with HiCache)
HICACHE_SYSTEMS = {
    "hicache": None,
    "vericache-hicache": {"full_kv": "device"},
    "vericache-store-hicache": {"full_kv": "store"},
}


# what B's /metrics count while it answers (VeriCache's series; absent elsewhere)
B_METRICS = {
    "store_prefix_tokens_b": "vericache_store_prefix_tokens_total",
    "full_kv_fetched_bytes_b": "vericache_full_kv_fetched_bytes_total",
    "full_kv_recomputes_b": "vericache_full_kv_recomputes_total",
    "_fetch_s": "vericache_full_kv_fetch_seconds_total",
    "_link_wait_s": "vericache_link_wait_seconds_total",
}


def _run_system(cfg: dict, system: str, ratio: float | None, documents: dict[str, str], logs: Path, log) -> list[dict]:
    """Both servers of ``system`` over one fresh store behind a link ``ratio`` times slower than this
    machine's memory (None: stock, which has no store); every document, A then B."""
    label = system if ratio is None else f"{system} (link ratio {ratio:g})"
    rows: list[dict] = []
    with store_server(logs) as store_url:
        args, vericache = _launch_args(cfg, system, store_url if ratio is None else f"{store_url}?link_ratio={ratio:g}")
        name = system if ratio is None else f"{system}-r{ratio:g}"
        servers = [SGLangServer(logs, f"{name}-{side}", *args, vericache=vericache, wait=False) for side in ("a", "b")]
        try:
            for s in servers:
                s.wait_healthy()
        except RuntimeError as e:
            for s in servers:
                s.stop()
            lines = str(e).strip().splitlines()  # the server's log tail: its last exception says why
            reason = next((line for line in reversed(lines) if re.search(r"\w+(Error|Exception): ", line)), lines[-1])
            reason = reason[:300]
            log(f"{label}: did not launch: {reason}")
            return [{"system": system, "link_ratio": ratio, "server": "a+b", "error": reason}]
        try:
            a, b = servers
            for doc, document in documents.items():
                for server, side, question in ((a, "a", cfg["questions"][0]), (b, "b", cfg["questions"][1])):
                    before = server.metrics()
                    with peak_tokens(server) as peak:
                        row = timed_chat(server, document, question, cfg["max_tokens"])
                    grown = server.metrics()
                    row = {"system": system, "link_ratio": ratio, "server": side, "document": doc, **row}
                    row["peak_kv_tokens"] = peak[0]
                    if side == "b" and system.startswith("vericache"):
                        row.update({k: metric_growth(grown, before, m) for k, m in B_METRICS.items()})
                        fetch_s, wait_s = row.pop("_fetch_s"), row.pop("_link_wait_s")
                        # the share of the fetch time the verify passes did not wait for: hidden by drafting
                        row["fetch_hidden_b"] = 1 - wait_s / fetch_s if fetch_s else None
                    rows.append(row)
                    log(
                        f"{label} {side} {doc}: ttft {row['ttft_s']:.2f} s, cached {row['cached_tokens']} of "
                        f"{row['prompt_tokens']}, {row['decode_tokens_per_s'] or 0:.1f} tok/s after it"
                    )
        finally:
            for s in servers:
                s.stop()
    return rows


def sglang_client(server: SGLangServer, cfg: dict, out: Path) -> dict:
    """SGLang's own benchmark client against ``server``: ``python -m sglang.benchmark.serving
    --dataset-name generated-shared-prefix`` (its prompts, seeded: groups of questions sharing a
    system prompt), greedy, every output's text kept (``--output-details``)."""
    g = cfg["sglang_client"]
    path = model_dir()
    command = [
        sys.executable, "-m", "sglang.benchmark.serving",
        "--backend", "sglang", "--base-url", server.url, "--model", path, "--tokenizer", path,
        "--dataset-name", "generated-shared-prefix", "--seed", str(g["seed"]),
        "--gsp-num-groups", str(g["groups"]), "--gsp-prompts-per-group", str(g["prompts_per_group"]),
        "--gsp-system-prompt-len", str(g["system_prompt_len"]), "--gsp-question-len", str(g["question_len"]),
        "--gsp-output-len", str(g["output_len"]), "--gsp-range-ratio", "1",
        "--num-prompts", str(g["groups"] * g["prompts_per_group"]),
        "--max-concurrency", str(g["max_concurrency"]), "--request-rate", "inf",
        "--output-file", str(out), "--output-details", "--disable-tqdm",
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800, cwd=out.parent)
    if done.returncode != 0 or not out.exists():
        raise RuntimeError(f"sglang.benchmark.serving failed ({done.returncode}): {done.stderr[-1500:]}")
    return json.loads(out.read_text().strip().splitlines()[-1])


def _run_client(cfg: dict, logs: Path, log) -> list[dict]:
    """Each system (stock first; those with a store at the first link ratio), one server each,
    under SGLang's own client; each output compared with stock's."""
    rows, texts = [], {}
    ratio = cfg["link_ratios"][0]
    for system in cfg["systems"]:
        with store_server(logs) as store_url:
            args, vericache = _launch_args(cfg, system, f"{store_url}?link_ratio={ratio:g}")
            server = SGLangServer(logs, f"client-{system}", *args, vericache=vericache)
            try:
                got = sglang_client(server, cfg, logs / f"client-{system}.jsonl")
            finally:
                server.stop()
        texts[system] = got["generated_texts"]
        rows.append(
            {
                "system": system,
                "link_ratio": None if system == "stock" else ratio,
                "requests": got["completed"],
                "errors": sum(1 for e in got["errors"] if e),
                "request_throughput": got["request_throughput"],
                "output_throughput": got["output_throughput"],
                "mean_ttft_ms": got["mean_ttft_ms"],
                "mean_e2e_latency_ms": got["mean_e2e_latency_ms"],
            }
        )
        log(f"sglang.benchmark.serving {system}: {got['completed']} requests, {got['output_throughput']:.1f} tok/s")
    stock = texts["stock"]
    for row in rows:
        same = sum(a == b for a, b in zip(texts[row["system"]], stock, strict=True))
        row["identical_to_stock"], row["outputs"] = same, len(stock)
    return rows


def run(config_path: Path | None = None, quick: bool = False, out_dir: Path | None = None, log=print) -> dict:
    cfg = load_config("sglang_prefix", config_path, quick)
    documents = _documents(cfg)
    logs = Path(tempfile.mkdtemp(prefix="vericache-sglang-prefix-"))
    log(f"SGLang remote prefix benchmark: {len(cfg['systems'])} systems x 2 servers, logs in {logs}")
    bandwidth = memory_bandwidth("cpu")
    log(f"memory bandwidth {bandwidth / 1e9:.1f} GB/s; links at ratios {cfg['link_ratios']}")
    runs = dict.fromkeys((s, None if s == "stock" else r) for s in cfg["systems"] for r in cfg["link_ratios"])
    rows = [row for system, ratio in runs for row in _run_system(cfg, system, ratio, documents, logs, log)]
    stock = {(r["server"], r["document"]): r for r in rows if r["system"] == "stock" and "error" not in r}
    for row in rows:
        ref = stock.get((row.get("server"), row.get("document")))
        if ref is None or "error" in row:
            continue
        row["identical_to_stock"] = row["_text"] == ref["_text"]
        row["ttft_vs_stock"] = row["ttft_s"] / ref["ttft_s"]
    for row in rows:
        row.pop("_text", None)
    client_rows = _run_client(cfg, logs, log) if cfg.get("sglang_client") else []
    checked = [r["identical_to_stock"] for r in rows if r["system"] != "stock" and "identical_to_stock" in r]
    checked += [r["identical_to_stock"] == r["outputs"] for r in client_rows]
    summary = {
        "config": {k: v for k, v in cfg.items() if k != "quick"},
        "memory_bandwidth_bytes_s": bandwidth,
        "quick": quick,
        "identical": all(checked),
        "rows": rows,
        "sglang_client_rows": client_rows,
    }
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        stem = "sglang_prefix" + ("_quick" if quick else "")
        (out / f"{stem}.json").write_text(json.dumps(summary, indent=2))
        cols = [
            "system",
            "link_ratio",
            "server",
            "document",
            "prompt_tokens",
            "cached_tokens",
            "ttft_s",
            "ttft_vs_stock",
            "decode_tokens_per_s",
            "peak_kv_tokens",
            "store_prefix_tokens_b",
            "full_kv_fetched_bytes_b",
            "fetch_hidden_b",
            "identical_to_stock",
            "error",
        ]
        client_md = (
            "\n## The same through SGLang's own client\n\n`python -m sglang.benchmark.serving "
            "--dataset-name generated-shared-prefix` (config `sglang_client`), one server each; "
            "`identical_to_stock`: of its `outputs`, those equal to stock's, text for text.\n\n"
            f"{table(client_rows, list(client_rows[0]))}\n"
            if client_rows
            else ""
        )
        (out / f"{stem}.md").write_text(
            "# Remote prefix caching across two SGLang servers on this CPU\n\n"
            "Server A answers a question over a document first; server B, which never saw it, answers "
            "another. `ttft_vs_stock`: against stock SGLang's same server and question. The store is "
            f"behind a link `link_ratio` times slower than this machine's memory "
            f"({bandwidth / 1e9:.1f} GB/s measured).\n\n"
            f"Config: `{json.dumps(summary['config'])}`\n\n{table(rows, cols)}\n" + client_md
        )
    return summary
