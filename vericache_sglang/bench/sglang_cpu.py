"""SGLang on this CPU: the same requests through stock SGLang and through VeriCache servers, one
``full_kv`` mode each, for each of the config's ``compressors`` (default: ``vericache.compressor``)
(``vericache bench sglang``; config ``benchmarks/configs/sglang_cpu.json``).

Each server runs alone (started, loaded, stopped, then the next), on the same machine, so their
numbers are side by side. Per server and load: completion tokens per second over the load's wall
time, the mean accepted length (tokens committed per verification, from the server's own
``/metrics``), draft passes per step and the share of drafts prompt lookup copied (``+lookup``),
the device KV pool's peak token usage as SGLang reports it, and how many answers are stock
SGLang's, text for text. Writes ``STEM.json``, ``STEM.md`` and a PNG (``stem``: ``sglang_cpu``).
"""

from __future__ import annotations

import contextlib
import json
import secrets
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path

from vericache_sglang.bench.common import REPO, load_config, table
from vericache_sglang.bench.sglang_server import (
    Ask,
    SGLangServer,
    accepted_length,
    document_prompt,
    metric_growth,
    run_load,
)


def _loads(cfg: dict) -> dict[str, list[Ask]]:
    prompts = {name: document_prompt(name, cfg["prompt_tokens"]) for load in cfg["loads"].values() for name, _ in load}
    return {
        label: [Ask(prompts[name], kind, max_tokens=cfg["max_tokens"]) for name, kind in load]
        for label, load in cfg["loads"].items()
    }


def _vericache_config(cfg: dict, mode: str, store_url: str | None, compressor: str | None = None) -> dict:
    out = {**cfg["vericache"], "full_kv": mode}
    if compressor is not None:
        out["compressor"] = compressor
    if mode == "store":
        out["store"] = store_url
    if mode in ("store", "host"):  # the full KV off the device: the reload room's share of the pool
        out.update(cfg.get("offload", {}))
    if mode == "host":
        out.update(cfg["host"])
    return out


def _measure(server: SGLangServer, loads: dict[str, list[Ask]], reference: dict | None, name: str, log) -> list[dict]:
    rows = []
    for label, questions in loads.items():
        before = server.metrics()
        result = run_load(server, questions)
        tokens = sum(a.completion_tokens or 0 for a in result.answers)
        row = {
            "server": name,
            "load": label,
            "requests": len(questions),
            "completion_tokens": tokens,
            "seconds": round(result.seconds, 2),
            "tokens_per_s": tokens / result.seconds,
            "peak_kv_tokens": int(result.peak_tokens),
            "mean_accepted_length": None,
            "draft_passes_per_step": None,
            "lookup_share": None,
            "full_kv_written_mib": None,
            "full_kv_fetched_mib": None,
            "recomputes": None,
        }
        if name != "stock":
            after = server.metrics()
            grown = partial(metric_growth, after, before)
            steps, drafted = grown("vericache_step_seconds_count"), grown("vericache_drafted_tokens_total")
            row.update(
                mean_accepted_length=accepted_length(after, before),
                draft_passes_per_step=grown("vericache_draft_passes_total") / steps if steps else None,
                lookup_share=grown("vericache_lookup_drafted_tokens_total") / drafted if drafted else None,
                full_kv_written_mib=grown("vericache_full_kv_written_bytes_total") / 2**20,
                full_kv_fetched_mib=grown("vericache_full_kv_fetched_bytes_total") / 2**20,
                recomputes=grown("vericache_full_kv_recomputes_total"),
            )
        if reference is not None:
            ref = reference[label]
            row["identical"] = sum(
                a.text == b.text and a.finish_reason == b.finish_reason
                for a, b in zip(ref, result.answers, strict=True)
            )
        else:
            reference_answers = result.answers
            row["identical"] = len(questions)
            row["_answers"] = reference_answers
        log(
            f"  {name:>16} {label:>12}: {row['tokens_per_s']:.2f} tok/s, peak {row['peak_kv_tokens']} KV tokens, "
            f"accepted {row['mean_accepted_length'] or '-'}, identical {row['identical']}/{len(questions)}"
        )
        rows.append(row)
    return rows


@contextlib.contextmanager
def store_server(logs: Path) -> Iterator[str]:
    """Our gRPC store server on loopback for ``full_kv: "store"``; yields its URL."""
    token = secrets.token_hex(8)
    (logs / "store.token").write_text(token)
    port_file = logs / "store.port"
    port_file.unlink(missing_ok=True)  # an earlier store's port, in a benchmark that starts several
    with open(logs / "store.log", "ab") as log_file:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "remote_store.server",
                "--listen",
                "127.0.0.1:0",
                "--capacity-bytes",
                str(4 << 30),
                "--auth-token-file",
                str(logs / "store.token"),
                "--port-file",
                str(port_file),
            ],
            cwd=REPO,
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )
        try:
            deadline = time.monotonic() + 60
            while not port_file.exists() or not port_file.read_text().strip():
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the store server did not start: see {logs / 'store.log'}")
                time.sleep(0.1)
            yield f"grpc://:{token}@127.0.0.1:{port_file.read_text().strip()}"
        finally:
            proc.terminate()
            proc.wait(30)


def run(config_path: Path | None = None, quick: bool = False, out_dir: Path | None = None, log=print) -> dict:
    cfg = load_config("sglang_cpu", config_path, quick)
    loads = _loads(cfg)
    logs = Path(tempfile.mkdtemp(prefix="vericache-sglang-bench-"))
    log(f"SGLang CPU benchmark: {len(cfg['modes']) + 1} servers, server logs in {logs}")
    rows: list[dict] = []
    stock = SGLangServer(logs, "stock", *cfg["server_args"])
    try:
        rows += _measure(stock, loads, None, "stock", log)
    finally:
        stock.stop()
    reference = {r["load"]: r.pop("_answers") for r in rows}
    compressors = cfg.get("compressors") or [cfg["vericache"]["compressor"]]
    with store_server(logs) as store_url:
        for compressor in compressors:
            for mode in cfg["modes"]:
                name = f"vericache {mode}" if len(compressors) == 1 else f"vericache {mode} {compressor}"
                server = SGLangServer(
                    logs,
                    f"vericache-{mode}-{compressors.index(compressor)}",
                    *cfg["server_args"],
                    vericache=_vericache_config(cfg, mode, store_url, compressor),
                )
                try:
                    rows += _measure(server, loads, reference, name, log)
                finally:
                    server.stop()
    for row in rows:
        stock_row = next(r for r in rows if r["server"] == "stock" and r["load"] == row["load"])
        row["vs_stock"] = row["tokens_per_s"] / stock_row["tokens_per_s"]
        row["kv_vs_stock"] = row["peak_kv_tokens"] / max(stock_row["peak_kv_tokens"], 1)
    summary = {"config": {k: v for k, v in cfg.items() if k != "quick"}, "quick": quick, "rows": rows}
    out = Path(out_dir) if out_dir else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        stem = cfg.get("stem", "sglang_cpu") + ("_quick" if quick else "")
        (out / f"{stem}.json").write_text(json.dumps(summary, indent=2))
        cols = [
            "server",
            "load",
            "requests",
            "tokens_per_s",
            "vs_stock",
            "mean_accepted_length",
            "draft_passes_per_step",
            "lookup_share",
            "peak_kv_tokens",
            "kv_vs_stock",
            "full_kv_written_mib",
            "full_kv_fetched_mib",
            "recomputes",
            "identical",
            "completion_tokens",
            "seconds",
        ]
        (out / f"{stem}.md").write_text(
            f"# SGLang on this CPU: stock against VeriCache\n\nConfig: "
            f"`{json.dumps(summary['config'])}`\n\n{table(rows, cols)}\n"
        )
        _plot(out / f"{stem}.png", rows)
    return summary


def _plot(path: Path, rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loads = list(dict.fromkeys(r["load"] for r in rows))
    servers = list(dict.fromkeys(r["server"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    width = 0.8 / len(servers)
    for k, (key, label) in enumerate((("tokens_per_s", "tokens/s"), ("peak_kv_tokens", "peak device KV tokens"))):
        ax = axes[k]
        for i, server in enumerate(servers):
            values = [next(r[key] for r in rows if r["server"] == server and r["load"] == load) for load in loads]
            ax.bar([j + i * width for j in range(len(loads))], values, width, label=server)
        ax.set_xticks([j + width * (len(servers) - 1) / 2 for j in range(len(loads))], loads)
        ax.set_ylabel(label)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("SGLang 0.5.23 on CPU, SmolLM2 float32: stock vs VeriCache (snapkv 1/8, x=8)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
