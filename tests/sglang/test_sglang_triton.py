"""SGLang's ``triton`` attention backend, the GPU servers' path, run on this CPU under Triton's
interpreter (``TRITON_INTERPRET=1``: every Triton kernel executes as NumPy on CPU tensors).

On it VeriCache verifies through the backend's own TARGET_VERIFY reading SGLang's custom mask (the
"masked" convention of flashinfer, triton and fa3), not the plugin's chain backend, and drafts through
the triton backend over the private compressed pool. Stock SGLang and a VeriCache server (SnapKV
at 1/8) both run SmolLM2 cut to its first two layers (the interpreter is slow), both with
``--enable-deterministic-inference`` (the only mode in which stock SGLang honours a seed; on CPU
through the platform layer's ``VERICACHE_CPU_DETERMINISTIC=1``, which leaves torch's CPU matmuls
where SGLang would install batch-invariant GPU kernels): greedy, JSON-schema and concurrent answers
identical to stock's, and a seeded sample (the heavy set: seeded and unseeded sampled answers of
every kind, token for token, on both of stock's sampling paths, ``step/seeded_draw.py``);
``/metrics`` shows which backend class ran every
TARGET_VERIFY pass, and drafts
accepted (draft passes reading the target pool's rows, as they did before the private pool got
a KV index translator of its own, commit under half as many tokens per verification). The heavy
set adds ``+refresh`` and ``+lookup``, whose chains are checked by the triton backend's masked
TARGET_VERIFY over the private pool.
"""

from __future__ import annotations

import pytest
from sglang_e2e import (
    COPY,
    MODIFIERS,
    PERSON_FORMAT,
    prompt,
    same_as_stock,
    stock_and_vericache,
)

from vericache_sglang.bench.sglang_server import MODEL, Ask, SGLangServer, accepted_length, metric_growth

pytestmark = [pytest.mark.real_model, pytest.mark.sglang]

LAYERS = 2
TRITON = ("--attention-backend", "triton", "--disable-overlap-schedule", "--enable-deterministic-inference")
INTERPRETED = {"TRITON_INTERPRET": "1", "VERICACHE_CPU_DETERMINISTIC": "1"}
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


def test_triton_backend_answers_as_stock_through_its_masked_verify(servers, exactness):
    stock, ours = servers
    before = ours.metrics()
    # short answers: a decode step of three interpreted requests takes stock ~7 s on a slow CPU, and
    # a VeriCache step (8 drafts and the masked verify) ~60 s; 12 tokens are still two
    # verifications or more at horizon 8, the JSON's grammar masking each of them
    questions = [
        Ask(COPY + prompt("code", 120), "completion", max_tokens=12),
        Ask("Give me a person as JSON.", "chat", max_tokens=12, params={"response_format": PERSON_FORMAT}),
        Ask(prompt("prose", 80), "chat", stream=True, max_tokens=12),
    ]
    same_as_stock(stock, ours, questions, exactness, f"triton (interpreted, SmolLM2 {LAYERS} layers)")
    after = ours.metrics()
    # a seeded sample, in a batch of its own (stock's plain sampling path); the heavy set asks every kind
    seeded = Ask(prompt("prose", 60), "completion", max_tokens=10, params={"temperature": 0.8, "seed": 7})
    same_as_stock(stock, ours, [seeded], exactness, "triton sampled, seeded")
    by_backend = ours.labelled("vericache_target_verify_forwards_total", "backend")
    assert set(by_backend) == {"TritonAttnBackend"}, by_backend  # the chain backend never ran
    assert metric_growth(after, before, "vericache_target_verify_forwards_total") > 0
    # drafts over the private pool accepted: 6.8 tokens per verification here; 2.8 when the draft
    # passes read the target pool's rows through the runner's KV index translator
    assert accepted_length(after, before) > 4.5, accepted_length(after, before)


def _top(k: int) -> dict:
    return {"extra_body": {"top_k": k}}


def sampled_as_stock(stock: SGLangServer, ours: SGLangServer, exactness, name: str, every_kind: bool) -> None:
    """Stock SGLang draws a sampled token with ``multinomial_with_seed`` keyed by (seed, position);
    an unseeded request gets seed 42. Which of its two paths it takes is a property of the batch
    (sorted when any request sets top-k, top-p or min-p, greedy ones included), so each batch here
    keeps to one path, as stock's own answers only repeat then. ``every_kind``: the heavy set's
    list (top-k, a JSON schema, streamed, ``n=2`` unseeded) beside the default set's."""
    text = prompt("prose", 60)
    sorted_path = [
        Ask(text, "completion", max_tokens=12, params={"temperature": 0.8, "top_p": 0.95, "seed": 1, "logprobs": 1}),
        Ask(
            text, "chat", max_tokens=12, params={"temperature": 0.8, "top_p": 0.95, "seed": 4, "presence_penalty": 0.5}
        ),
        Ask(text, "completion", max_tokens=12),  # greedy: top_k 1
    ]
    plain_path = [
        Ask(text, "completion", max_tokens=12, params={"temperature": 0.8, "seed": 7}),
        Ask("Name three colours.", "chat", max_tokens=12, params={"temperature": 0.8}),  # unseeded: seed 42
    ]
    n2 = [{"seed": 9}]
    if every_kind:
        sorted_path += [
            Ask(
                "Name three colours.",
                "chat",
                max_tokens=16,
                params={"temperature": 0.9, "top_p": 0.9, "seed": 2, **_top(40)},
            ),
            Ask(
                "Give me a person as JSON.",
                "chat",
                max_tokens=24,
                params={"temperature": 0.7, "top_p": 0.9, "seed": 3, "response_format": PERSON_FORMAT},
            ),
            Ask(
                COPY + prompt("code", 60),
                "completion",
                stream=True,
                max_tokens=16,
                params={"temperature": 1.0, "seed": 5, **_top(20)},
            ),
            # SGLang's own sampler at every step (logit bias, a frequency penalty), top log-probs, a stop string
            Ask(
                text,
                "completion",
                max_tokens=12,
                params={"temperature": 0.8, "top_p": 0.9, "seed": 6, "logit_bias": {"13": 5.0}},
            ),
            Ask(
                text,
                "chat",
                max_tokens=12,
                params={"temperature": 0.8, "top_p": 0.9, "seed": 10, "frequency_penalty": 0.7},
            ),
            Ask(
                text, "completion", max_tokens=12, params={"temperature": 0.8, "top_p": 0.9, "seed": 12, "logprobs": 3}
            ),
            Ask(
                text,
                "completion",
                max_tokens=24,
                params={"temperature": 0.8, "top_p": 0.9, "seed": 13, "stop": [" and"]},
            ),
        ]
        plain_path.append(
            Ask("Name three colours.", "chat", stream=True, max_tokens=16, params={"temperature": 1.0, "seed": 8})
        )
        n2.append({})
    same_as_stock(stock, ours, sorted_path, exactness, f"{name} sampled, sorted path")
    same_as_stock(stock, ours, plain_path, exactness, f"{name} sampled, plain path")
    for params in n2:  # n=2: every choice gets the request's seed in stock
        answers = [
            [
                c.text
                for c in s.client()
                .completions.create(model=MODEL, prompt=text, max_tokens=8, n=2, temperature=0.9, **params)
                .choices
            ]
            for s in (stock, ours)
        ]
        exactness(f"sglang {name} n=2 {params}", {"identical": answers[0] == answers[1], "compared_tokens": 16})
        assert answers[0] == answers[1], answers


@pytest.mark.slow  # the default set's seeded request is in the test above
def test_sampled_requests_are_stocks_token_for_token(servers, exactness):
    sampled_as_stock(*servers, exactness, "triton", every_kind=False)


@pytest.mark.slow
def test_every_sampled_kind_is_stocks_with_the_full_kv_on_the_device_and_in_host_memory(
    servers, sglang_logs, model, exactness
):
    stock, ours = servers
    sampled_as_stock(stock, ours, exactness, "triton", every_kind=True)
    host = SGLangServer(
        sglang_logs,
        "vericache-triton-host",
        "--model-path",
        model,
        *TRITON,
        env=INTERPRETED,
        vericache={**SNAPKV, "full_kv": "host", "reload_room": 0.2, "host_pool_ratio": 1.0},
    )
    try:
        sampled_as_stock(stock, host, exactness, "triton host", every_kind=True)
    finally:
        host.stop()


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
