"""A bounded load on the demo cluster, and the store killed under it.

Runs docker-compose.yml's cpu profile on loopback (deploy/cluster.py: our gRPC store, two VeriCache
servers sharing it; no LMCache, no RAG client), registers a shared document, and takes each
prompt's full-KV reference once (``vericache.check``). Then ``--streams`` client threads of this
process send streaming requests for ``--seconds`` (prompts with and without the document, both
servers), while the store is SIGKILLed at 30% of the run and started again (empty) 15% later.

Every request must end one of two ways: complete, its tokens identical to the reference; or failed
cleanly (an error event or status), everything it streamed before a prefix of the reference. Never
a token that is not the reference's (no unverified token escapes). Requests started once the
store is back must complete without falling back. Writes ``serve_load.json``, ``serve_load.md``
and a timeline plot; exit status 0 when all of that holds.

    python benchmarks/serve_load.py [--streams 8] [--seconds 60] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "deploy"))
import cluster  # noqa: E402

from vericache_sglang.bench.common import table  # noqa: E402
from vericache_sglang.serve.rag_client import ClusterError, chat_stream, metric, wait_for_documents  # noqa: E402

QUESTIONS = (
    "Summarise the document in one sentence.",
    "What is the first thing the document says?",
    "Name one detail from the document.",
    "Why does the document matter?",
)
RECOVERY_GRACE_S = 5.0  # requests started this long after the store is back must not fall back


def _prompts(doc: str) -> list[list[dict]]:
    with_doc = [[{"role": "system", "content": doc}, {"role": "user", "content": q}] for q in QUESTIONS[:2]]
    plain = [[{"role": "user", "content": f"{q} The document: {doc[:600]}"}] for q in QUESTIONS[2:]]
    return with_doc + plain


def run(streams: int, seconds: float, max_tokens: int, out_dir: Path, log=print) -> dict:
    work = Path(tempfile.mkdtemp(prefix="vericache-load-"))
    c = cluster.LocalCluster.from_compose(work, without=("lmcache", "rag-client", "redis"))
    c.up(log=log)
    servers = [c.url("vericache-a"), c.url("vericache-b")]
    doc = (REPO / "benchmarks" / "prompts" / "prose.txt").read_text()[:2500]
    events: list[dict] = []
    try:
        with httpx.Client(timeout=600) as client:
            r = client.post(f"{servers[0]}/v1/prefixes", json={"text": doc, "name": "load-doc"})
            r.raise_for_status()
            wait_for_documents(client, servers, [r.json()["digest"]], 120.0)  # both hold it before the load
            prompts = _prompts(doc)
            refs = []
            for i, messages in enumerate(prompts):
                out = chat_stream(
                    client,
                    servers[i % 2],
                    {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "vericache": {"check": True}},
                )
                check = out["vericache"]["check"]
                if not check["identical"]:
                    raise ClusterError(f"prompt {i}: the reference run was not identical to full-KV decoding: {check}")
                refs.append(out["tokens"])
            log(f"references taken for {len(prompts)} prompts; load: {streams} streams for {seconds:.0f} s")

        t0 = time.monotonic()
        stop = threading.Event()
        lock = threading.Lock()

        def stream(worker: int) -> None:
            i = worker
            with httpx.Client(timeout=600) as client:
                while not stop.is_set():
                    k, server = i % len(prompts), servers[i % 2]
                    i += streams
                    got: list[int] = []
                    rec = {"worker": worker, "prompt": k, "server": server, "start": time.monotonic() - t0}
                    try:
                        out = chat_stream(
                            client, server, {"messages": prompts[k], "max_tokens": max_tokens, "temperature": 0}, got
                        )
                        rec.update(
                            outcome="ok",
                            fallbacks=out["vericache"]["store_fallbacks"],
                            prefix_tokens=out["vericache"]["prefix_tokens"],
                        )
                    except (ClusterError, httpx.HTTPError) as e:
                        rec.update(outcome="failed", error=str(e)[:300])
                    rec.update(
                        end=time.monotonic() - t0,
                        tokens=len(got),
                        exact=got == refs[k] if rec["outcome"] == "ok" else got == refs[k][: len(got)],
                    )
                    with lock:
                        events.append(rec)

        threads = [threading.Thread(target=stream, args=(w,), daemon=True) for w in range(streams)]
        for t in threads:
            t.start()
        time.sleep(0.3 * seconds)
        killed_at = time.monotonic() - t0
        c.stop("store", signal.SIGKILL)
        log(f"store killed at {killed_at:.1f} s")
        time.sleep(0.15 * seconds)
        c.start("store")
        c.wait("store", "service_healthy")
        back_at = time.monotonic() - t0
        log(f"store back (empty) at {back_at:.1f} s")
        time.sleep(max(0.0, seconds - back_at))
        stop.set()
        for t in threads:
            t.join(600)
        with httpx.Client(timeout=30) as client:
            health = {s: client.get(f"{s}/health").status_code for s in servers}
            metrics = {s: client.get(f"{s}/metrics").text for s in servers}
    finally:
        codes = c.down()
    after = [e for e in events if e["start"] >= back_at + RECOVERY_GRACE_S]
    during = [e for e in events if e["end"] >= killed_at and e["start"] <= back_at]
    summary = {
        "streams": streams,
        "seconds": seconds,
        "max_tokens": max_tokens,
        "requests": len(events),
        "ok": sum(e["outcome"] == "ok" for e in events),
        "failed_cleanly": sum(e["outcome"] == "failed" for e in events),
        "unverified_or_wrong_tokens": sum(not e["exact"] for e in events),
        "requests_touching_outage": len(during),
        "outage_fallbacks": sum(e.get("fallbacks", 0) > 0 for e in during),
        "outage_failed": sum(e["outcome"] == "failed" for e in during),
        "after_recovery": len(after),
        "after_recovery_ok_without_fallback": sum(e["outcome"] == "ok" and e["fallbacks"] == 0 for e in after),
        "store_killed_at_s": killed_at,
        "store_back_at_s": back_at,
        "tokens_per_s": sum(e["tokens"] for e in events) / seconds,
        "servers_healthy_after": all(code == 200 for code in health.values()),
        "clean_shutdown": all(code == 0 for code in codes.values()),
        "store_errors_metric": [metric(m, "vericache_store_errors_total") for m in metrics.values()],
    }
    summary["passed"] = (
        summary["unverified_or_wrong_tokens"] == 0
        and summary["requests"] > 0
        and summary["after_recovery"] > 0
        and summary["after_recovery_ok_without_fallback"] == summary["after_recovery"]
        and summary["servers_healthy_after"]
        and summary["clean_shutdown"]
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "serve_load.json").write_text(json.dumps({"summary": summary, "requests": events}, indent=1))
    cols = [
        "requests",
        "ok",
        "failed_cleanly",
        "unverified_or_wrong_tokens",
        "requests_touching_outage",
        "outage_fallbacks",
        "outage_failed",
        "after_recovery",
        "after_recovery_ok_without_fallback",
        "tokens_per_s",
        "passed",
    ]
    (out_dir / "serve_load.md").write_text(
        f"# Serving under load, store killed at {killed_at:.0f} s, back at {back_at:.0f} s\n\n"
        f"`python benchmarks/serve_load.py --streams {streams} --seconds {seconds:g} --max-tokens {max_tokens}`: "
        f"two SmolLM2 servers sharing our gRPC store on loopback (CPU).\n\n{table([summary], cols)}\n"
    )
    _plot(events, killed_at, back_at, out_dir / "serve_load.png")
    log(json.dumps({k: v for k, v in summary.items()}, indent=1))
    return summary


def _plot(events: list[dict], killed_at: float, back_at: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    colors = {"ok": "tab:green", "failed": "tab:orange"}
    for e in events:
        color = colors[e["outcome"]] if e["exact"] else "red"
        if e["outcome"] == "ok" and e.get("fallbacks"):
            color = "tab:blue"
        ax.plot(
            [e["start"], e["end"]],
            [e["worker"], e["worker"]],
            color=color,
            lw=3,
            marker="|",
            markersize=12,
            markeredgecolor="black",
            solid_capstyle="butt",
        )
    ax.axvspan(killed_at, back_at, color="grey", alpha=0.2, label="store down")
    for label, color in (
        ("complete", "tab:green"),
        ("complete, fell back to recompute", "tab:blue"),
        ("failed cleanly", "tab:orange"),
        ("wrong token", "red"),
    ):
        ax.plot([], [], color=color, lw=3, label=label)
    ax.set_xlabel("seconds")
    ax.set_ylabel("client stream")
    ax.set_title("Requests under load; the store killed and restarted")
    ax.legend(loc="upper right", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = p.parse_args(argv)
    summary = run(args.streams, args.seconds, args.max_tokens, args.out, log=lambda s: print(s, file=sys.stderr))
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
