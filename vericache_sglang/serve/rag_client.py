"""The demo cluster's RAG client: shared documents registered once, questions about them sent to
every server, acceptance, time to first token and identity with full-KV decoding printed.

1. waits for the servers' ``/health``;
2. registers each document on the first server (``POST /v1/prefixes``: its full KV goes to the
   shared store, listed in the store's catalog) and waits until every server holds a copy;
3. streams chat requests (the document as the system message, then a question) to the servers in
   turn, each with ``vericache.check``: the server also decodes with the full KV and compares;
   one request per document names its compressor, which skips the document (a plain prefill), for
   the time-to-first-token baseline;
4. scrapes every server's ``/metrics``.

``vericache rag-client --servers http://a:8000,http://b:8001 --documents d1.txt d2.txt``; exit
status 0 only when every answer is identical to full-KV decoding and every server served
requests from a shared document.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from remote_store.health import probe

QUESTIONS = ("Summarise the document in two sentences.", "What is the most important detail in the document?")


class ClusterError(RuntimeError):
    """A server refused, failed, or did not become ready."""


def _wait(what: str, ready: Callable[[], bool], timeout_s: float, every_s: float = 0.5) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if ready():
                return
        except Exception as e:  # not up yet
            last = e
        else:
            last = None
        if time.monotonic() > deadline:
            raise ClusterError(f"{what}: not ready after {timeout_s:.0f} s" + (f" ({last})" if last else ""))
        time.sleep(every_s)


def metric(text: str, name: str) -> float:
    """A sample's value from Prometheus text, summed over its label sets (0 when absent)."""
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + " ") or line.startswith(name + "{")
    )


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def wait_for_documents(client: httpx.Client, servers: list[str], digests: list[str], timeout_s: float) -> None:
    """Return when every server holds a copy of every document (it follows the store's catalog)."""
    for s in servers:

        def holds(s: str = s) -> bool:
            have = {d["digest"] for d in client.get(f"{s}/v1/prefixes").json()["data"]}
            return all(d in have for d in digests)

        _wait(f"{s}: shared documents", holds, timeout_s)


def chat_stream(client: httpx.Client, server: str, body: dict, tokens: list[int] | None = None) -> dict:
    """Stream one chat request; return its verified token ids, text, time to first token and stats.
    ``tokens``, when given, receives the token ids as they arrive, so a caller still has what was
    streamed when the request fails."""
    t0 = time.monotonic()
    first = None
    tokens = [] if tokens is None else tokens
    text = ""
    final: dict = {}
    with client.stream("POST", f"{server}/v1/chat/completions", json={**body, "stream": True}) as r:
        if r.status_code != 200:
            raise ClusterError(f"{server}: HTTP {r.status_code}: {r.read().decode(errors='replace')}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise ClusterError(f"{server}: {chunk['error']['message']}")
            choice = chunk["choices"][0]
            if choice.get("token_ids"):
                first = first if first is not None else time.monotonic() - t0
                tokens += choice["token_ids"]
            text += choice["delta"].get("content") or ""
            if "vericache" in chunk:
                final = chunk
    if not final:
        raise ClusterError(f"{server}: the stream ended without its final chunk")
    return {
        "tokens": tokens,
        "text": text,
        "ttft_s": first,
        "total_s": time.monotonic() - t0,
        "vericache": final["vericache"],
        "usage": final["usage"],
    }


def run(
    servers: list[str],
    documents: list[Path],
    questions: tuple[str, ...] = QUESTIONS,
    max_tokens: int = 32,
    doc_chars: int = 2500,
    api_key: str | None = None,
    wait_s: float = 300.0,
    log: Callable[[str], None] = print,
) -> dict:
    servers = [s.rstrip("/") for s in servers]
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    for s in servers:
        _wait(f"{s}/health", lambda s=s: probe(s) is None, wait_s)
    log(f"servers up: {', '.join(servers)}")
    with httpx.Client(headers=headers, timeout=600) as client:
        docs = []
        for path in documents:
            text = path.read_text()[:doc_chars]
            r = client.post(f"{servers[0]}/v1/prefixes", json={"text": text, "name": path.stem})
            if r.status_code != 200:
                raise ClusterError(f"registering {path}: HTTP {r.status_code}: {r.text}")
            doc = r.json() | {"text": text}
            docs.append(doc)
            log(
                f"document {doc['name']}: {doc['tokens']} tokens registered on {servers[0]} in {doc['seconds']:.1f} s "
                f"({doc['compressor']}, copy {doc['compressed_kv_bytes'] / 2**20:.2f} MiB)"
            )
        wait_for_documents(client, servers, [d["digest"] for d in docs], wait_s)
        log(f"every server holds a copy of {len(docs)} document(s)")
        rows = []
        turn = 0
        for doc in docs:
            for q in questions:
                server = servers[turn % len(servers)]
                turn += 1
                messages = [{"role": "system", "content": doc["text"]}, {"role": "user", "content": q}]
                out = chat_stream(
                    client,
                    server,
                    {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "vericache": {"check": True}},
                )
                v, check = out["vericache"], out["vericache"]["check"] or {}
                rows.append(
                    {
                        "server": server,
                        "document": doc["name"],
                        "question": q,
                        "shared": True,
                        "prefix_tokens": v["prefix_tokens"],
                        "ttft_s": out["ttft_s"],
                        "total_s": out["total_s"],
                        "tokens": len(out["tokens"]),
                        "mean_accepted_length": v["mean_accepted_length"],
                        "identical": check.get("identical"),
                        "max_logit_abs_diff": check.get("max_logit_abs_diff"),
                    }
                )
                log(
                    f"{server} {doc['name']}: prefix {v['prefix_tokens']} tok, TTFT {out['ttft_s']:.2f} s, "
                    f"accepted {v['mean_accepted_length']:.2f}/verify, identical={check.get('identical')} "
                    f"(max |dlogit| {check.get('max_logit_abs_diff')})"
                )
            # the baseline: a request that names its compressor skips the shared copy: the document's full
            # KV is fetched from the store and the rest of the prompt prefilled (fetch-then-decode)
            messages = [{"role": "system", "content": doc["text"]}, {"role": "user", "content": questions[0]}]
            out = chat_stream(
                client,
                servers[0],
                {
                    "messages": messages,
                    "max_tokens": max_tokens,
                    "temperature": 0,
                    "vericache": {"compressor": doc["compressor"], "check": True},
                },
            )
            check = out["vericache"]["check"] or {}
            rows.append(
                {
                    "server": servers[0],
                    "document": doc["name"],
                    "question": questions[0],
                    "shared": False,
                    "prefix_tokens": out["vericache"]["prefix_tokens"],
                    "ttft_s": out["ttft_s"],
                    "total_s": out["total_s"],
                    "tokens": len(out["tokens"]),
                    "mean_accepted_length": out["vericache"]["mean_accepted_length"],
                    "identical": check.get("identical"),
                    "max_logit_abs_diff": check.get("max_logit_abs_diff"),
                }
            )
            log(
                f"{servers[0]} {doc['name']} (fetch-then-decode, no shared copy): TTFT {out['ttft_s']:.2f} s, "
                f"identical={check.get('identical')}"
            )
        metrics = {}
        for s in servers:
            text = client.get(f"{s}/metrics").text
            metrics[s] = {
                "prefix_hits": metric(text, "vericache_prefix_hits_total"),
                "documents": metric(text, "vericache_documents"),
                "requests_ok": metric(text, 'vericache_requests_total{status="ok"}'),
                "verify_passes": metric(text, "vericache_verify_passes_total"),
                "full_kv_fetched_bytes": metric(text, "vericache_full_kv_fetched_bytes_total"),
            }
    shared = [r for r in rows if r["shared"]]
    baseline = [r for r in rows if not r["shared"]]
    summary = {
        "identical": all(r["identical"] is True for r in rows),
        "requests": len(rows),
        "every_server_served_shared_documents": all(m["prefix_hits"] > 0 for m in metrics.values()),
        "ttft_s_shared_document": _mean([r["ttft_s"] for r in shared]),
        "ttft_s_fetch_then_decode": _mean([r["ttft_s"] for r in baseline]),
        "mean_accepted_length": _mean([r["mean_accepted_length"] for r in shared]),
        "max_logit_abs_diff": max((r["max_logit_abs_diff"] or 0.0) for r in rows),
        "metrics": metrics,
        "rows": rows,
    }
    log(
        f"{len(rows)} requests, identical to full-KV decoding: {summary['identical']}; TTFT with a shared document "
        f"{summary['ttft_s_shared_document']:.2f} s vs fetch-then-decode {summary['ttft_s_fetch_then_decode']:.2f} s; "
        f"mean accepted length {summary['mean_accepted_length']:.2f}"
    )
    return summary
