"""The demo cluster's SGLang client: questions about shared documents sent to SGLang servers
launched with ``--enable-vericache`` (directly, or through SGLang's router), each answer checked
token for token against the project's own full-KV decoding (run here, on the same token ids), with
SGLang's cached prefix tokens, the server's acceptance and its ``vericache_*`` metrics reported.

1. waits for the server's ``/health``;
2. for each document, sends the questions in turn (the document as the system message), through
   SGLang's native ``/generate`` on the chat template's token ids, greedy, with log-probabilities;
3. decodes the same ids with the full KV here and compares: tokens, and the largest difference of
   the chosen tokens' log-probabilities;
4. with ``--workers`` (the servers behind a router): asks each worker one more question about each
   document directly. A worker the router never sent the document to has it in no radix tree; its
   prefix comes from the shared full-KV store (``vericache_store_prefix_hits_total`` grows), so
   it is reported cached and not prefilled; the answer is checked like the others;
5. scrapes each server's ``/metrics``.

``vericache sglang-client --server http://router:30080 --workers http://sglang-a:30000
http://sglang-b:30000 --documents d1.txt d2.txt`` (each file's first ``--doc-chars`` characters are
its document); exit status 0 only when every answer is identical to full-KV decoding, every later
question about a document was served from its cached prefix and, with ``--workers``, every
document was served on some worker from the store.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import httpx

from vericache_sglang.serve.rag_client import QUESTIONS, ClusterError, _wait, metric

SERIES = (
    "vericache_verify_passes_total",
    "vericache_generated_tokens_total",
    "vericache_accepted_length_sum",
    "vericache_accepted_length_count",
    "vericache_full_kv_written_bytes_total",
    "vericache_store_errors_total",
    "vericache_full_kv_fetched_bytes_total",
    "vericache_full_kv_recomputes_total",
    "vericache_store_prefix_hits_total",
    "vericache_store_prefix_tokens_total",
    "vericache_prefix_copies_made_total",
    "vericache_prefix_copy_hits_total",
)
# asked of every worker directly, after the questions through the router (``workers``)
WORKER_QUESTION = "In a few words, what is the document about?"
STORE_HITS = "vericache_store_prefix_hits_total"


def run(
    server: str,
    documents: list[str | Path],
    questions: tuple[str, ...] = QUESTIONS,
    max_tokens: int = 32,
    doc_chars: int = 2500,
    timeout_s: float = 900.0,
    log: Callable[[str], None] = print,
    workers: tuple[str, ...] = (),
) -> dict:
    from vericache_sglang.engine.engine import Engine

    server, workers = server.rstrip("/"), tuple(w.rstrip("/") for w in workers)
    for url in (server, *workers):
        _wait(url, lambda url=url: httpx.get(f"{url}/health", timeout=5).status_code == 200, timeout_s)
    engine = Engine("smollm2")
    texts = {Path(doc).name: Path(doc).read_text()[:doc_chars] for doc in documents}
    rows = []
    for name, text in texts.items():
        for i, question in enumerate(questions):
            rows.append(_ask(engine, server, name, text, question, max_tokens, timeout_s, log))
            rows[-1]["later_question"] = i > 0
    cross = []
    for name, text in texts.items() if workers else ():
        for w in workers:
            hits = _metrics(w)[STORE_HITS]
            row = _ask(engine, w, name, text, WORKER_QUESTION, max_tokens, timeout_s, log)
            row["from_store"] = _metrics(w)[STORE_HITS] > hits
            log(f"  {w}: the prefix of {name} loaded from the store: {row['from_store']}")
            cross.append(row)
    later_cached = all(r["cached_tokens"] > 0 for r in rows if r["later_question"])
    every = rows + cross
    return {
        "server": server,
        "requests": len(every),
        "identical": all(r["identical"] for r in every),
        "later_questions_cached": later_cached and all(r["cached_tokens"] > 0 for r in cross),
        "documents_served_from_the_store": sorted({r["document"] for r in cross if r["from_store"]}),
        "every_document_from_the_store": {r["document"] for r in cross if r["from_store"]} == set(texts)
        if workers
        else None,
        "rows": rows,
        "worker_rows": cross,
        "metrics": _metrics(server) if not workers else {w: _metrics(w) for w in workers},
    }


def _metrics(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return {name: metric(text, name) for name in SERIES}


def _ask(
    engine, url: str, name: str, text: str, question: str, max_tokens: int, timeout_s: float, log: Callable
) -> dict:
    """One question about one document at ``url``, checked against full-KV decoding here."""
    eos = set(engine.eos_token_ids)
    ids = list(
        engine.tokenizer.apply_chat_template(
            [{"role": "system", "content": text}, {"role": "user", "content": question}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
        )["input_ids"]
    )
    t0 = time.perf_counter()
    r = httpx.post(
        f"{url}/generate",
        timeout=timeout_s,
        json={
            "input_ids": ids,
            "return_logprob": True,
            "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0.0},
        },
    )
    if r.status_code != 200:
        raise ClusterError(f"{url}/generate answered {r.status_code}: {r.text[:500]}")
    seconds = time.perf_counter() - t0
    out = r.json()
    ref = engine.generate(engine.prefill(ids), "full", cfg=engine.config(max_new_tokens=max_tokens, keep_logits=True))
    got = [t for t in out["output_ids"] if t not in eos]
    want = [t for t in ref.tokens if t not in eos]
    served = [lp for lp, *_ in out["meta_info"].get("output_token_logprobs", [])]
    expected = [float(lg.float().log_softmax(-1)[t]) for lg, t in zip(ref.logits, ref.tokens, strict=True)]
    n = min(len(served), len(expected))
    row = {
        "server": url,
        "document": name,
        "question": question,
        "prompt_tokens": len(ids),
        "cached_tokens": out["meta_info"].get("cached_tokens", 0),
        "generated": len(got),
        "identical": got == want,
        "max_logprob_abs_diff": max((abs(a - b) for a, b in zip(served[:n], expected[:n], strict=True)), default=None),
        "accepted_length": out["meta_info"].get("spec_accept_length"),
        "seconds": round(seconds, 2),
    }
    log(
        f"{url} {name} '{question}': {len(got)} tokens in {seconds:.1f} s, cached {row['cached_tokens']} of "
        f"{len(ids)}, accepted length {row['accepted_length']}, identical to full-KV decoding: "
        f"{row['identical']} (max |dlogprob| {row['max_logprob_abs_diff']})"
    )
    return row
