"""Quantizing compressors inside SGLang: the draft pool holds codes, dequantized a layer at a time
where attention reads it (``draft/dequant_pool.py``). Every answer is stock SGLang's, and the
worker commits as many tokens per verification as the reference engine with the same compressor
on the same prompt (within 5%), so its drafts are the engine's. The default set runs SnapKV + KIVI
4-bit; the heavy set KIVI alone, int8 and a composition with refresh."""

from __future__ import annotations

import pytest
from sglang_e2e import COPY, PERSON_FORMAT, prompt, same_as_stock

from vericache_sglang.bench.sglang_server import Ask, SGLangServer, metric_growth

pytestmark = [pytest.mark.real_model, pytest.mark.sglang]

COMPOSED = "snapkv:ratio=0.4+kivi:bits=4,group=64,residual=64"
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
    verifications = metric_growth(server.metrics(), before, "vericache_accepted_length_count")
    cfg = engine.config(max_new_tokens=NEW_TOKENS, horizon=HORIZON, eos_token_ids=())
    res = engine.generate(engine.prefill(tokens, reuse_prefix=False), "vericache", spec, cfg)
    worker, reference = (NEW_TOKENS - 1) / verifications, res.stats.mean_accepted_length
    same = out["output_ids"] == res.tokens
    exactness(
        f"sglang {spec} vs engine", {"identical": same, "compared_tokens": NEW_TOKENS}, worker=worker, engine=reference
    )
    assert same
    assert abs(worker / reference - 1) <= 0.05, (worker, reference)


def test_a_dropper_with_kivi_answers_as_stock_and_drafts_as_the_engine(
    stock_server, sglang_logs, real_engine, exactness
):
    server = _server(sglang_logs, COMPOSED)
    try:
        questions = [
            Ask(prompt("prose"), "completion", max_tokens=24, params={"logprobs": 1}),
            Ask(COPY + prompt("code", 400), "chat", stream=True, max_tokens=24),
            Ask("Give me a person as JSON.", "chat", max_tokens=24, params={"response_format": PERSON_FORMAT}),
        ]
        same_as_stock(stock_server, server, questions, exactness, f"quantized {COMPOSED}")
        as_the_engine_drafts(server, real_engine, COMPOSED, exactness)
    finally:
        server.stop()


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
    server = _server(sglang_logs, spec)
    try:
        same_as_stock(
            stock_server,
            server,
            [Ask(COPY + prompt("code", 400), "completion", max_tokens=24)],
            exactness,
            f"quantized {spec}",
        )
        as_the_engine_drafts(server, real_engine, spec, exactness)
    finally:
        server.stop()
