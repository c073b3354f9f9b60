"""The drafting modifiers in real SGLang servers: ``+refresh`` (rows re-chosen at every
verification from the verify pass's own queries over the full KV in SGLang's pool) and ``+lookup``
(prompt-lookup chains checked in one TARGET_VERIFY pass over the private pool), held token for
token to stock SGLang: single and concurrent requests, a copy-heavy prompt, a JSON schema in the
batch and alone with a copyable object (lookup chains under the grammar), a shared document (the
prefix-copy path), seeded sampling against the project's full-KV sampling (with the full KV on
the host: ``tests/test_sglang_e2e_modes.py``). The server's ``/metrics`` show the refreshes and
the lookup drafts happened, and fewer draft passes than drafts."""

from __future__ import annotations

import json
from functools import partial

import jsonschema
import pytest
from conftest import SGLANG_TEST_FLAGS
from sglang_e2e import COPY, MODIFIERS, PERSON, PERSON_FORMAT, compare_answers, prompt, same_as_stock

from vericache_sglang.bench.sglang_server import Ask, SGLangServer, accepted_length, ask, ask_all, metric_growth

pytestmark = [pytest.mark.real_model, pytest.mark.sglang]



@pytest.fixture(scope="module")
def refreshing(sglang_logs):
    server = SGLangServer(sglang_logs, "vericache-modifiers", *SGLANG_TEST_FLAGS, vericache=MODIFIERS)
    yield server
    server.stop()


def test_refresh_and_lookup_answer_as_stock_alone_and_in_a_batch(stock_server, refreshing, exactness):
    before = refreshing.metrics()
    same_as_stock(stock_server, refreshing, [Ask(prompt("prose"), "completion", max_tokens=32, params={"logprobs": 1}),
                                             Ask(prompt("code"), "chat", stream=True, max_tokens=24),
                                             Ask(COPY + prompt("code", 400), "chat", max_tokens=64)],
                  exactness, "refresh+lookup")
    _, got = same_as_stock(stock_server, refreshing, [
        Ask(prompt("tools", 1200), "chat", max_tokens=24),
        Ask("Describe Ada Lovelace as a JSON object with her name and age.", "chat", max_tokens=64,
            params={"response_format": PERSON_FORMAT}),
        Ask("def quicksort(arr):", "completion", max_tokens=56, params={"stop": ["\ndef "]}),
        Ask("The capital of France is", "completion", max_tokens=30, params={"stop": ["."]}),
        Ask(prompt("prose", 1400), "completion", max_tokens=16),
        Ask(COPY + prompt("code", 300), "completion", max_tokens=48),
    ], exactness, "refresh+lookup batch")
    jsonschema.validate(json.loads(got[1].text), PERSON)
    after = refreshing.metrics()

    grown = partial(metric_growth, after, before)

    assert 0 < grown("vericache_refreshes_total") <= grown("vericache_verify_passes_total")  # one per verification
    assert grown("vericache_lookup_drafted_tokens_total") > 0
    # lookup chains are checked in one pass each: fewer passes than drafts (a pass serves the batch)
    assert grown("vericache_draft_passes_total") < grown("vericache_drafted_tokens_total")
    assert accepted_length(after, before) > 1.5
    exactness("sglang refresh+lookup: this test's 9 answers, from /metrics", {
        "identical": True, "compared_tokens": int(grown("vericache_generated_tokens_total")),
        "accepted_length": accepted_length(after, before), "verifications": grown("vericache_verify_passes_total"),
        "drafted": grown("vericache_drafted_tokens_total"),
        "lookup_drafted": grown("vericache_lookup_drafted_tokens_total"),
        "draft_passes": grown("vericache_draft_passes_total"), "refreshes": grown("vericache_refreshes_total")})


def test_lookup_chains_under_a_json_schema(stock_server, refreshing, exactness):
    """The object to write is in the prompt, with a property the schema forbids: the lookup window
    walks the grammar (chains stop before a forbidden token) and the answer is stock's."""
    text = ('Here is a record: {"name": "Ada Lovelace", "age": 36, "city": "London"}\n'
            "Write it as a JSON object with only her name and age.")
    before = refreshing.metrics()
    _, got = same_as_stock(stock_server, refreshing, [Ask(text, "chat", max_tokens=48,
                                                          params={"response_format": PERSON_FORMAT})],
                           exactness, "refresh+lookup json schema, lookup under the grammar")
    assert json.loads(got[0].text) == {"name": "Ada Lovelace", "age": 36}, got[0].text
    assert metric_growth(refreshing.metrics(), before, "vericache_lookup_drafted_tokens_total") > 0


def test_refresh_over_a_shared_documents_compressed_copy(stock_server, refreshing, exactness):
    """The prefix-copy path: the second question over a cached document drafts over the document's
    compressed copy (made then, cloned into its row, its own tokens folded in, its rows refreshed by
    its verifications; the tree's copy stays the document's); each answer is stock's."""
    document = prompt("prose", 1200)
    before = refreshing.metrics()
    for i, text in enumerate(["What is a block?", "What does the global statement change?"]):
        q = Ask(text, "chat", max_tokens=16, system=document)
        cmp = compare_answers(ask(stock_server, q), ask(refreshing, q))
        exactness(f"sglang refresh+lookup radix prefix, question {i + 1}", cmp)
        assert cmp["identical"], cmp
    after = refreshing.metrics()
    # the second question matched the cached document: its copy was made, cloned into its row
    assert metric_growth(after, before, "vericache_prefix_copies_made_total") == 1


@pytest.mark.slow
def test_refresh_with_seeded_sampling_is_full_kv_sampling(refreshing, real_engine, exactness):
    from vericache_sglang.core.sampling import SamplingParams

    text = "Write a short story about a lighthouse keeper who finds a message in a bottle."
    tokens = real_engine.encode(text)
    ref = real_engine.generate(real_engine.prefill(tokens, reuse_prefix=False), "full", cfg=real_engine.config(
        max_new_tokens=48, sampling=SamplingParams(temperature=0.8, top_p=0.95, seed=11)))
    out = refreshing.generate(tokens, {"max_new_tokens": 48, "temperature": 0.8, "top_p": 0.95, "sampling_seed": 11})
    got = [t for t in out["output_ids"] if t not in real_engine.eos_token_ids]
    want = [t for t in ref.tokens if t not in real_engine.eos_token_ids]
    exactness("sglang refresh+lookup seeded sampling vs engine full-KV sampling",
              {"identical": got == want, "compared_tokens": len(want)})
    assert got == want


@pytest.mark.slow
def test_modifiers_under_rejection_sampling_with_the_store(stock_server, sglang_logs, exactness):
    """``verification: "rejection"`` takes each lookup window's draft distributions (the model's
    on the draft stream; one-hot for a chain's tokens drafted unchecked at the window's end):
    greedy requests stay stock's; seeded sampled ones complete (what rejection commits depends on
    the draft's probabilities, which move with the compressed KV a request drafts over: a second
    run of the same prompt drafts over the radix cache's compressed copy, so sampled text is not
    compared across runs; its distribution is the verifier's, ``tests/test_sglang_sampling.py``);
    the full KV also goes to the store."""
    server = SGLangServer(sglang_logs, "vericache-modifiers-rejection", *SGLANG_TEST_FLAGS,
                          vericache={**MODIFIERS, "verification": "rejection", "full_kv": "store"})
    try:
        same_as_stock(stock_server, server, [Ask(COPY + prompt("code", 300), "completion", max_tokens=64),
                                             Ask(prompt("prose"), "chat", max_tokens=32)],
                      exactness, "refresh+lookup rejection")
        sampled = Ask(COPY + prompt("code", 300), "chat", max_tokens=48,
                      params={"temperature": 0.7, "top_p": 0.95, "seed": 5})
        batched = ask_all(server, [sampled, Ask(prompt("tools"), "completion", max_tokens=24,
                                                params={"temperature": 0.9, "seed": 2})])
        assert all(a.text and a.finish_reason in ("length", "stop") for a in batched)
        m = server.metrics()
        assert m["vericache_lookup_drafted_tokens_total"] > 0 and m["vericache_full_kv_written_bytes_total"] > 0
        assert m["vericache_store_errors_total"] == 0
    finally:
        server.stop()
