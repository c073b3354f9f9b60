"""SGLang's ``triton`` attention backend, the GPU servers' path, run on this CPU under Triton's
interpreter (``TRITON_INTERPRET=1``: every Triton kernel executes as NumPy on CPU tensors).

On it VeriCache verifies through the backend's own TARGET_VERIFY reading SGLang's custom mask (the
"masked" convention of flashinfer, triton and fa3), not the plugin's chain backend, and drafts through
the triton backend over the private compressed pool. Stock SGLang and a VeriCache server (SnapKV
at 1/8) both run SmolLM2 cut to its first two layers (the interpreter is slow): greedy, JSON-schema
and concurrent answers identical to stock's, a seeded one identical to the project's full-KV
sampling of the same model (stock SGLang ignores seeds without deterministic inference, which
needs a GPU); ``/metrics`` shows which backend class ran every TARGET_VERIFY pass, and drafts
accepted (draft passes reading the target pool's rows, as they did before the private pool got
a KV index translator of its own, commit under half as many tokens per verification). The heavy
set adds ``+refresh`` and ``+lookup``, whose chains are checked by the triton backend's masked
TARGET_VERIFY over the private pool.
"""

from __future__ import annotations

import concurrent.futures as cf

import pytest
from sglang_e2e import (
    COPY,
    MODIFIERS,
    PERSON_FORMAT,
    prompt,
    same_as_stock,
    seeded_as_full_kv_sampling,
    stock_and_vericache,
)

from vericache_sglang.bench.sglang_server import Ask, SGLangServer, accepted_length, metric_growth

pytestmark = [pytest.mark.real_model, pytest.mark.sglang]

LAYERS = 2
TRITON = ("--attention-backend", "triton", "--disable-overlap-schedule")
INTERPRETED = {"TRITON_INTERPRET": "1"}
SNAPKV = {"compressor": "snapkv:ratio=0.125", "horizon": 8, "full_kv": "device"}  # drafts from the model alone


@pytest.fixture(scope="module")
def model():
    from vericache_sglang.engine.model_variants import smollm2_first_layers

    return str(smollm2_first_layers(LAYERS))


@pytest.fixture(scope="module")
def servers(sglang_logs, model):
    pytest.importorskip("sglang.srt.entrypoints.http_server", reason="sglang is not installed")
    with stock_and_vericache(sglang_logs, "triton", ("--model-path", model, *TRITON), SNAPKV, INTERPRETED) as pair:
        yield pair


@pytest.fixture(scope="module")
def engine(model):
    from vericache_sglang.engine.engine import Engine

    return Engine(model)


def test_triton_backend_answers_as_stock_through_its_masked_verify(servers, engine, exactness):
    stock, ours = servers
    before = ours.metrics()
    questions = [
        Ask(COPY + prompt("code", 120), "completion", max_tokens=24),
        Ask("Give me a person as JSON.", "chat", max_tokens=24, params={"response_format": PERSON_FORMAT}),
        Ask(prompt("prose", 80), "chat", stream=True, max_tokens=16),
    ]
    with cf.ThreadPoolExecutor(1) as pool:  # the seeded request beside the batch: a batch of its own kinds
        seeded = pool.submit(
            seeded_as_full_kv_sampling, ours, engine, "Name a colour.", 12, exactness, "sglang triton seeded vs engine"
        )
        same_as_stock(stock, ours, questions, exactness, f"triton (interpreted, SmolLM2 {LAYERS} layers)")
        seeded.result()
    after = ours.metrics()
    by_backend = ours.labelled("vericache_target_verify_forwards_total", "backend")
    assert set(by_backend) == {"TritonAttnBackend"}, by_backend  # the chain backend never ran
    assert metric_growth(after, before, "vericache_target_verify_forwards_total") > 0
    # drafts over the private pool accepted: 6.8 tokens per verification here; 2.8 when the draft
    # passes read the target pool's rows through the runner's KV index translator
    assert accepted_length(after, before) > 4.5, accepted_length(after, before)


@pytest.mark.slow
def test_drafting_modifiers_on_the_triton_backend(servers, sglang_logs, model, exactness):
    """``+refresh`` and ``+lookup`` (a lookup chain's check is a TARGET_VERIFY over the private pool,
    here through the triton backend's masked path too): stock's text, only triton ran."""
    stock, _ = servers
    ours = SGLangServer(
        sglang_logs, "vericache-triton-modifiers", "--model-path", model, *TRITON, env=INTERPRETED, vericache=MODIFIERS
    )
    try:
        questions = [
            Ask(COPY + prompt("code", 120), "completion", max_tokens=32),
            Ask(prompt("tools", 100), "chat", max_tokens=16),
        ]
        same_as_stock(stock, ours, questions, exactness, "triton modifiers")
        m = ours.metrics()
        assert m["vericache_lookup_drafted_tokens_total"] > 0 and m["vericache_refreshes_total"] > 0
        assert set(ours.labelled("vericache_target_verify_forwards_total", "backend")) == {"TritonAttnBackend"}
    finally:
        ours.stop()
