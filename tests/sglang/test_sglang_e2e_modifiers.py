"""The drafting modifiers in real SGLang servers, the heavy set's part: ``+refresh`` (rows
re-chosen at every verification from the verify pass's own queries over the full KV in SGLang's
pool) and ``+lookup`` (prompt-lookup chains checked in one TARGET_VERIFY pass over the private
pool), with seeded sampling against the project's full-KV sampling, and under rejection sampling
with the store. The default set runs both modifiers on the session's shared server
(``sglang_e2e.MODIFIERS``): every test of ``tests/sglang/test_sglang_e2e.py`` (single,
streamed and concurrent requests, a copy-heavy prompt, JSON schemas with lookup chains under the
grammar, tool calls, a shared document's compressed copy, seeded sampling, and ``/metrics``
showing refreshes and lookup drafts with fewer draft passes than drafts)."""

from __future__ import annotations

import pytest
from conftest import SGLANG_TEST_FLAGS
from sglang_e2e import COPY, MODIFIERS, prompt, same_as_stock, seeded_as_full_kv_sampling

from vericache_sglang.bench.sglang_server import Ask, SGLangServer, ask_all

pytestmark = [pytest.mark.real_model, pytest.mark.sglang]


@pytest.fixture(scope="module")
def refreshing(sglang_logs):
    server = SGLangServer(sglang_logs, "vericache-modifiers", *SGLANG_TEST_FLAGS, vericache=MODIFIERS)
    yield server
    server.stop()


@pytest.mark.slow
def test_refresh_with_seeded_sampling_is_full_kv_sampling(refreshing, real_engine, exactness):
    text = "Write a short story about a lighthouse keeper who finds a message in a bottle."
    seeded_as_full_kv_sampling(
        refreshing, real_engine, text, 48, exactness, "sglang refresh+lookup seeded sampling vs engine full-KV sampling"
    )


@pytest.mark.slow
def test_modifiers_under_rejection_sampling_with_the_store(stock_server, sglang_logs, exactness):
    """``verification: "rejection"`` takes each lookup window's draft distributions (the model's
    on the draft stream; one-hot for a chain's tokens drafted unchecked at the window's end):
    greedy requests stay stock's; seeded sampled ones complete (what rejection commits depends on
    the draft's probabilities, which move with the compressed KV a request drafts over: a second
    run of the same prompt drafts over the radix cache's compressed copy, so sampled text is not
    compared across runs; its distribution is the verifier's, ``tests/sglang/test_sglang_sampling.py``);
    the full KV also goes to the store."""
    server = SGLangServer(
        sglang_logs,
        "vericache-modifiers-rejection",
        *SGLANG_TEST_FLAGS,
        vericache={**MODIFIERS, "verification": "rejection", "full_kv": "store"},
    )
    try:
        same_as_stock(
            stock_server,
            server,
            [Ask(COPY + prompt("code", 300), "completion", max_tokens=64), Ask(prompt("prose"), "chat", max_tokens=32)],
            exactness,
            "refresh+lookup rejection",
        )
        sampled = Ask(
            COPY + prompt("code", 300), "chat", max_tokens=48, params={"temperature": 0.7, "top_p": 0.95, "seed": 5}
        )
        batched = ask_all(
            server, [sampled, Ask(prompt("tools"), "completion", max_tokens=24, params={"temperature": 0.9, "seed": 2})]
        )
        assert all(a.text and a.finish_reason in ("length", "stop") for a in batched)
        m = server.metrics()
        assert m["vericache_lookup_drafted_tokens_total"] > 0 and m["vericache_full_kv_written_bytes_total"] > 0
        assert m["vericache_store_errors_total"] == 0
    finally:
        server.stop()
