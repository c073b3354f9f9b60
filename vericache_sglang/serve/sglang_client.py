"""The demo cluster's SGLang client: questions about shared documents sent to an SGLang server
launched with ``--enable-vericache``, each answer checked token for token against the project's own
full-KV decoding (run here, on the same token ids), with SGLang's cached prefix tokens, the
server's acceptance and its ``vericache_*`` metrics reported.

1. waits for the server's ``/health``;
2. for each document, sends the questions in turn (the document as the system message), through
   SGLang's native ``/generate`` on the chat template's token ids, greedy, with log-probabilities;
3. decodes the same ids with the full KV here and compares: tokens, and the largest difference of
   the chosen tokens' log-probabilities;
4. scrapes the server's ``/metrics``.

``vericache sglang-client --server http://sglang:30000 --documents d1.txt d2.txt`` (each file's first
``--doc-chars`` characters are its document); exit status 0
only when every answer is identical to full-KV decoding and every later question about a document
was served from its cached prefix.
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
    "vericache_prefix_copies_made_total",
    "vericache_prefix_copy_hits_total",
)


def run(
    server: str,
    documents: list[str | Path],
    questions: tuple[str, ...] = QUESTIONS,
    max_tokens: int = 32,
    doc_chars: int = 2500,
    timeout_s: float = 900.0,
    log: Callable[[str], None] = print,
) -> dict:
    from vericache_sglang.engine.engine import Engine

    server = server.rstrip("/")
    _wait(server, lambda: httpx.get(f"{server}/health", timeout=5).status_code == 200, timeout_s)
    engine = Engine("smollm2")
    eos = set(engine.eos_token_ids)
    rows = []
    for doc in documents:
        text = Path(doc).read_text()[:doc_chars]
        for i, question in enumerate(questions):
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
                f"{server}/generate",
                timeout=timeout_s,
                json={
                    "input_ids": ids,
                    "return_logprob": True,
                    "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0.0},
                },
            )
            if r.status_code != 200:
                raise ClusterError(f"{server}/generate answered {r.status_code}: {r.text[:500]}")
            seconds = time.perf_counter() - t0
            out = r.json()
            ref = engine.generate(
                engine.prefill(ids), "full", cfg=engine.config(max_new_tokens=max_tokens, keep_logits=True)
            )
            got = [t for t in out["output_ids"] if t not in eos]
            want = [t for t in ref.tokens if t not in eos]
            served = [lp for lp, *_ in out["meta_info"].get("output_token_logprobs", [])]
            expected = [float(lg.float().log_softmax(-1)[t]) for lg, t in zip(ref.logits, ref.tokens, strict=True)]
            n = min(len(served), len(expected))
            row = {
                "document": Path(doc).name,
                "question": question,
                "prompt_tokens": len(ids),
                "cached_tokens": out["meta_info"].get("cached_tokens", 0),
                "generated": len(got),
                "identical": got == want,
                "max_logprob_abs_diff": max(
                    (abs(a - b) for a, b in zip(served[:n], expected[:n], strict=True)), default=None
                ),
                "accepted_length": out["meta_info"].get("spec_accept_length"),
                "seconds": round(seconds, 2),
                "later_question": i > 0,
            }
            rows.append(row)
            log(
                f"{row['document']} q{i + 1}: {len(got)} tokens in {seconds:.1f} s, cached {row['cached_tokens']} of "
                f"{len(ids)}, accepted length {row['accepted_length']}, identical to full-KV decoding: "
                f"{row['identical']} (max |dlogprob| {row['max_logprob_abs_diff']})"
            )
    text = httpx.get(f"{server}/metrics", timeout=30).text
    metrics = {name: sum(metric(line, name) for line in text.splitlines() if line.startswith(name)) for name in SERIES}
    cached_ok = all(r["cached_tokens"] > 0 for r in rows if r["later_question"])
    return {
        "server": server,
        "requests": len(rows),
        "identical": all(r["identical"] for r in rows),
        "later_questions_cached": cached_ok,
        "rows": rows,
        "metrics": metrics,
    }
