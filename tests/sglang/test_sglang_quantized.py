"""Quantizing compressors inside SGLang: the draft pool holds codes, dequantized a layer at a time
where attention reads it (``draft/dequant_pool.py``). Every answer is stock SGLang's, and the
worker commits as many tokens per verification as the reference engine with the same compressor
on the same prompt (within 5%), so its drafts are the engine's. The default set runs KVzip (its
probes and per-layer budgets) + KIVI 4-bit + refresh + lookup; the heavy set the recommended spec
(SnapKV + KIVI + refresh + lookup), KIVI alone, int8, a composition with refresh, PyramidKV and
Ada-KV + KIVI."""

from __future__ import annotations

import pytest
from sglang_e2e import COPY, PERSON_FORMAT, prompt, same_as_stock

from vericache_sglang.bench.sglang_server import Ask, SGLangServer, metric_growth
from vericache_sglang.core.compress import RECOMMENDED

pytestmark = [pytest.mark.real_model, pytest.mark.sglang]

HORIZON = 16
NEW_TOKENS = 64


def _server(sglang_logs, spec: str, **extra) -> SGLangServer:
    return SGLangServer(
        sglang_logs,
        f"vericache-{spec.split(':')[0]}-quantized",
        vericache={"compressor": spec, "horizon": HORIZON, "full_kv": "device", **extra},
    )


def as_the_engine_drafts(server: SGLangServer, engine, spec: str, exactness) -> None:
    """One greedy request on its own: the worker's tokens per verification against the engine's.
    Both count the tokens after the first (drawn at prefill) over their verifications; the worker's
    own metric would also count what its last verification committed past ``max_new_tokens``,
    which SGLang trims."""
    tokens = engine.encode(prompt("prose", 1000), chat=False)
    before = server.metrics()
    out = server.generate(tokens, {"max_new_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True})
    after = server.metrics()
    verifications = metric_growth(after, before, "vericache_accepted_length_count")
    # the engine compresses the whole prompt: so must the worker, not draft over a compressed copy
    # of a prefix an earlier request cached (a different compression, drafting differently)
    for copies in ("vericache_prefix_copy_hits_total", "vericache_prefix_copies_made_total"):
        assert metric_growth(after, before, copies) == 0, f"the prompt reused a cached prefix ({copies})"
    cfg = engine.config(max_new_tokens=NEW_TOKENS, horizon=HORIZON, eos_token_ids=())
    res = engine.generate(engine.prefill(tokens, reuse_prefix=False), "vericache", spec, cfg)
    worker, reference = (NEW_TOKENS - 1) / verifications, res.stats.mean_accepted_length
    same = out["output_ids"] == res.tokens
    exactness(
        f"sglang {spec} vs engine", {"identical": same, "compared_tokens": NEW_TOKENS}, worker=worker, engine=reference
    )
    assert same
    assert abs(worker / reference - 1) <= 0.05, (worker, reference)


def drafts_as_the_engine_and_answers_as_stock(
    stock_server, sglang_logs, engine, exactness, spec: str, questions
) -> None:
    """A VeriCache server with ``spec``: first the engine comparison (on a prompt the server has not
    seen), then ``questions`` against stock."""
    server = _server(sglang_logs, spec)
    try:
        as_the_engine_drafts(server, engine, spec, exactness)
        same_as_stock(stock_server, server, questions, exactness, f"quantized {spec}")
    finally:
        server.stop()


QUESTIONS = [
    Ask(prompt("prose"), "completion", max_tokens=24, params={"logprobs": 1}),
    Ask(COPY + prompt("code", 400), "chat", stream=True, max_tokens=24),
    Ask("Give me a person as JSON.", "chat", max_tokens=24, params={"response_format": PERSON_FORMAT}),
]


@pytest.mark.slow
def test_the_recommended_spec_answers_as_stock_and_drafts_as_the_engine(
    stock_server, sglang_logs, real_engine, exactness
):
    drafts_as_the_engine_and_answers_as_stock(stock_server, sglang_logs, real_engine, exactness, RECOMMENDED, QUESTIONS)


@pytest.mark.slow
@pytest.mark.parametrize(
    "spec",
    [
        "kivi:bits=2,group=32,residual=32",
        "int8",
        "snapkv:ratio=0.3+kivi:bits=4,group=64,residual=64+refresh:ratio=0.0125,span=14",
    ],
)
def test_each_quantizer_answers_as_stock_and_drafts_as_the_engine(
    stock_server, sglang_logs, real_engine, exactness, spec
):
    questions = [Ask(COPY + prompt("code", 400), "completion", max_tokens=24)]
    drafts_as_the_engine_and_answers_as_stock(stock_server, sglang_logs, real_engine, exactness, spec, questions)


KVZIP = "kvzip:ratio=0.3+kivi:bits=4,group=64,residual=64+refresh:ratio=0.0125,span=14+lookup:trust=0"


def test_kvzip_probes_in_the_pool_answers_as_stock_and_drafts_as_the_engine(
    stock_server, sglang_logs, real_engine, exactness
):
    """KVzip's reconstruction probes run in SGLang's pool (``step/probe.py``) and its budgets,
    ranked over all layers, differ per layer (``draft/layer_rows.py``): the worker's drafts are
    the engine's, whose probes run in its own runner and whose layers keep their own counts, and
    every answer is stock's."""
    # two of the three questions: the JSON schema under quantized drafting is the heavy set's
    # recommended-spec test (the default set's budget)
    drafts_as_the_engine_and_answers_as_stock(stock_server, sglang_logs, real_engine, exactness, KVZIP, QUESTIONS[:2])


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["pyramidkv:ratio=0.3", "adakv:ratio=0.3+kivi:bits=4,group=64,residual=64"])
def test_per_layer_budgets_answer_as_stock_and_draft_as_the_engine(
    stock_server, sglang_logs, real_engine, exactness, spec
):
    """Per-layer budgets in the plain pool (PyramidKV: every layer's slots are the largest
    layer's) and in the dequantizing pool (Ada-KV's per-layer maxima over KIVI codes)."""
    questions = [Ask(prompt("prose"), "completion", max_tokens=24)]
    drafts_as_the_engine_and_answers_as_stock(stock_server, sglang_logs, real_engine, exactness, spec, questions)
