"""Remote prefix caching across SGLang servers on this CPU (``vericache bench sglang-prefix``;
config ``benchmarks/configs/sglang_prefix.json``, fixed before measuring).

Two servers of one system, A and B, side by side; for each document (a real prompt's document cut
to about ``document_tokens`` tokens, the system message), one question to A, then another to B,
each streamed. B never saw the document. Three systems, one after the other on the same machine:

- ``stock``: stock SGLang; B prefills the document (its radix tree is its own);
- ``vericache``: ``--enable-vericache`` with ``full_kv: "store"``, both over one fresh gRPC store;
  B loads the document's full KV that A wrote from the store into its radix tree instead of
  prefilling it, then drafts and verifies as usual;
- ``hicache``: stock SGLang with HiCache (``--enable-hierarchical-cache``) over the same kind of
  store through our HiCache storage backend (``vericache_sglang/sglang/storage.py``), SGLang's own
  way of sharing a prefix through L3 storage; when it does not launch on this machine, its row
  says why.

Per question: time to first token, tokens/s after it, the prompt tokens SGLang reports cached,
B's peak device KV (``sglang:num_used_tokens``, polled), and whether B's answer is stock B's, text
for text. Writes ``sglang_prefix.json`` and ``.md``.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

from vericache_sglang.bench.common import load_config, table
from vericache_sglang.bench.sglang_cpu import _store_server
from vericache_sglang.bench.sglang_server import SGLangServer, document_prompt, peak_tokens


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
    if system == "hicache":
        extra = {**cfg["hicache"]["extra_config"], "store_url": store_url}
        return [*args, *cfg["hicache"]["args"], "--hicache-storage-backend-extra-config", json.dumps(extra)], None
    return args, None


def _run_system(cfg: dict, system: str, documents: dict[str, str], logs: Path, log) -> list[dict]:
    rows: list[dict] = []
    with _store_server(logs) as store_url:
        args, vericache = _launch_args(cfg, system, store_url)
        servers = [
            SGLangServer(logs, f"{system}-{side}", *args, vericache=vericache, wait=False) for side in ("a", "b")
        ]
        try:
            for s in servers:
                s.wait_healthy()
        except RuntimeError as e:
            for s in servers:
                s.stop()
            reason = str(e).strip().splitlines()[-1][:300]
            log(f"{system}: did not launch: {reason}")
            return [{"system": system, "server": "a+b", "error": reason}]
        try:
            a, b = servers
            for name, document in documents.items():
                for server, side, question in ((a, "a", cfg["questions"][0]), (b, "b", cfg["questions"][1])):
                    with peak_tokens(server) as peak:
                        row = timed_chat(server, document, question, cfg["max_tokens"])
                    rows.append({"system": system, "server": side, "document": name, **row, "peak_kv_tokens": peak[0]})
                    log(
                        f"{system} {side} {name}: ttft {row['ttft_s']:.2f} s, cached {row['cached_tokens']} of "
                        f"{row['prompt_tokens']}, {row['decode_tokens_per_s'] or 0:.1f} tok/s after it"
                    )
            grown = b.metrics()
            for row in rows:
                if row["server"] == "b" and system == "vericache":
                    row["store_prefix_hits_b"] = grown.get("vericache_store_prefix_hits_total", 0.0)
        finally:
            for s in servers:
                s.stop()
    return rows


def run(config_path: Path | None = None, quick: bool = False, out_dir: Path | None = None, log=print) -> dict:
    cfg = load_config("sglang_prefix", config_path, quick)
    documents = _documents(cfg)
    logs = Path(tempfile.mkdtemp(prefix="vericache-sglang-prefix-"))
    log(f"SGLang remote prefix benchmark: {len(cfg['systems'])} systems x 2 servers, logs in {logs}")
    rows = [row for system in cfg["systems"] for row in _run_system(cfg, system, documents, logs, log)]
    stock = {(r["server"], r["document"]): r for r in rows if r["system"] == "stock" and "error" not in r}
    for row in rows:
        ref = stock.get((row.get("server"), row.get("document")))
        if ref is None or "error" in row:
            continue
        row["identical_to_stock"] = row["_text"] == ref["_text"]
        row["ttft_vs_stock"] = row["ttft_s"] / ref["ttft_s"]
    for row in rows:
        row.pop("_text", None)
    checked = [r["identical_to_stock"] for r in rows if r["system"] != "stock" and "identical_to_stock" in r]
    summary = {
        "config": {k: v for k, v in cfg.items() if k != "quick"},
        "quick": quick,
        "identical": all(checked),
        "rows": rows,
    }
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        stem = "sglang_prefix" + ("_quick" if quick else "")
        (out / f"{stem}.json").write_text(json.dumps(summary, indent=2))
        cols = [
            "system",
            "server",
            "document",
            "prompt_tokens",
            "cached_tokens",
            "ttft_s",
            "ttft_vs_stock",
            "decode_tokens_per_s",
            "peak_kv_tokens",
            "identical_to_stock",
            "error",
        ]
        (out / f"{stem}.md").write_text(
            "# Remote prefix caching across two SGLang servers on this CPU\n\n"
            "Server A answers a question over a document first; server B, which never saw it, answers "
            "another. `ttft_vs_stock`: against stock SGLang's same server and question.\n\n"
            f"Config: `{json.dumps(summary['config'])}`\n\n{table(rows, cols)}\n"
        )
    return summary
