"""The OpenAI-compatible server on SmolLM2, in process (FastAPI's test client): outputs identical
to full-KV decoding, streaming that only ever holds verified text, the limits' 4xx errors, the API
key, and the Prometheus metrics."""

import json
import threading

import pytest
from conftest import PROMPTS
from fastapi.testclient import TestClient

from vericache_sglang.serve.openai_api import TextDeltas, create_app
from vericache_sglang.serve.service import EngineService, Limits

pytestmark = pytest.mark.real_model

KEY = "test-key-123"
AUTH = {"Authorization": f"Bearer {KEY}"}
NEW = 24


@pytest.fixture(scope="module")
def service(real_engine):
    svc = EngineService(
        real_engine,
        "snapkv:ratio=0.25",
        horizon=8,
        limits=Limits(max_prompt_tokens=4096, max_new_tokens=256, max_concurrency=4),
    )
    svc.start()
    yield svc
    svc.stop()


@pytest.fixture(scope="module")
def client(service):
    with TestClient(create_app(service, "smollm2", api_key=KEY)) as c:
        yield c


@pytest.fixture(scope="module")
def prompt(real_engine):
    return real_engine.encode((PROMPTS / "tools.txt").read_text())[:1200]


@pytest.fixture(scope="module")
def reference(real_engine, prompt):
    pre = real_engine.prefill(prompt, reuse_prefix=False)
    return real_engine.generate(pre, "full", cfg=real_engine.config(max_new_tokens=NEW))


def complete(client, prompt, **kw):
    body = {"prompt": prompt, "max_tokens": NEW, "temperature": 0, **kw}
    return client.post("/v1/completions", json=body, headers=AUTH)


def test_completion_is_identical_to_full_kv(client, prompt, reference, exactness):
    r = complete(client, prompt, vericache={"compressor": "kivi:bits=2", "horizon": 16})
    assert r.status_code == 200, r.text
    body = r.json()
    choice = body["choices"][0]
    identical = choice["token_ids"] == reference.tokens
    exactness(
        "SmolLM2 server /v1/completions kivi:bits=2",
        {"identical": identical, "first_mismatch": None, "compared_tokens": NEW, "max_logit_abs_diff": None},
    )
    assert identical and choice["text"] == reference.text
    assert body["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": NEW, "total_tokens": len(prompt) + NEW}
    v = body["vericache"]
    assert v["compressor"].startswith("kivi:bits=2") and v["horizon"] == 16 and v["verify_passes"] >= 1
    assert v["mean_accepted_length"] >= 1.0


def test_stream_carries_the_same_verified_text(client, prompt, reference):
    with client.stream(
        "POST",
        "/v1/completions",
        headers=AUTH,
        json={"prompt": prompt, "max_tokens": NEW, "temperature": 0, "stream": True},
    ) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == reference.text
    streamed = [t for c in chunks[:-1] for t in c["choices"][0]["token_ids"]]
    assert streamed == reference.tokens  # every streamed id verified, in order, none more
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and chunks[-1]["usage"]["completion_tokens"] == NEW
    assert len(chunks) > 2  # it streamed, not one block


def test_concurrent_requests_each_identical(client, real_engine, prompt):
    prompts = [prompt[: 600 + 150 * i] for i in range(3)]
    refs = [
        real_engine.generate(
            real_engine.prefill(p, reuse_prefix=False), "full", cfg=real_engine.config(max_new_tokens=16)
        )
        for p in prompts
    ]
    out: dict[int, dict] = {}

    def run(i):
        out[i] = complete(client, prompts[i], max_tokens=16).json()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all("choices" in out[i] for i in range(3)), out
    assert [out[i]["choices"][0]["token_ids"] for i in range(3)] == [r.tokens for r in refs]


def test_chat_completion(client, real_engine):
    messages = [{"role": "user", "content": "Name three primary colours."}]
    tokens = real_engine.encode("Name three primary colours.")
    ref = real_engine.generate(
        real_engine.prefill(tokens, reuse_prefix=False), "full", cfg=real_engine.config(max_new_tokens=20)
    )
    r = client.post(
        "/v1/chat/completions", headers=AUTH, json={"messages": messages, "max_tokens": 20, "temperature": 0}
    )
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == ref.text
    with client.stream(
        "POST",
        "/v1/chat/completions",
        headers=AUTH,
        json={"messages": messages, "max_tokens": 20, "temperature": 0, "stream": True},
    ) as s:
        chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    assert "".join(c["choices"][0]["delta"]["content"] for c in chunks) == ref.text


@pytest.mark.parametrize(
    "body,status,fragment",
    [
        ({"max_tokens": 100000}, 400, "max_tokens must be in"),
        ({"vericache": {"compressor": "h2oo"}}, 400, "unknown compressor"),
        ({"vericache": {"horizon": 0}}, 400, "horizon must be in"),
        ({"vericache": {"colour": "red"}}, 400, "vericache.colour"),
        ({"n": 2}, 400, "n > 1"),
        ({"model": "gpt-9"}, 404, "is not served here"),
        ({"top_p": 0}, 400, "top_p"),
        ({"prompt": [1, 10**9]}, 400, "token ids must be in"),
        ({"prompt": "x" * 3}, 200, ""),
    ],
)
def test_bad_requests_are_clear_4xx(client, body, status, fragment):
    r = client.post("/v1/completions", headers=AUTH, json={"prompt": [1, 2, 3], "max_tokens": 4, **body})
    assert r.status_code == status, r.text
    if status != 200:
        assert fragment in r.json()["error"]["message"]


def test_prompt_limits_and_api_key(client):
    r = client.post("/v1/completions", headers=AUTH, json={"prompt": [5] * 5000, "max_tokens": 4})
    assert r.status_code == 400 and "at most 4096" in r.json()["error"]["message"]
    assert client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2}).status_code == 401
    bad = {"Authorization": "Bearer nope"}
    assert client.post("/v1/completions", headers=bad, json={"prompt": [1, 2], "max_tokens": 2}).status_code == 401
    assert client.get("/v1/models", headers=AUTH).json()["data"][0]["id"] == "smollm2"
    assert client.get("/health").json()["status"] == "ok"


def test_concurrency_limit_is_429(real_engine, prompt):
    svc = EngineService(real_engine, "snapkv:ratio=0.25", horizon=8, limits=Limits(max_concurrency=1))
    # not started: the first request stays in flight, so the second is over the limit
    with TestClient(create_app(svc, "smollm2")) as c:
        from vericache_sglang.core.sampling import SamplingParams

        svc.submit(prompt[:100], max_new_tokens=4, sampling=SamplingParams())
        r = c.post("/v1/completions", json={"prompt": prompt[:100], "max_tokens": 4})
        assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_exceeded"
        assert c.get("/health").status_code == 503  # the engine thread is not running


def test_metrics_are_scraped(client, prompt):
    complete(client, prompt[:300], max_tokens=8)
    text = client.get("/metrics").text
    for name in (
        "vericache_requests_total",
        "vericache_generated_tokens_total",
        "vericache_verify_passes_total",
        "vericache_accepted_length_bucket",
        "vericache_full_kv_fetched_bytes_total",
        "vericache_link_wait_seconds_total",
        "vericache_store_errors_total",
        "vericache_decode_tokens_per_second",
        "vericache_requests_in_flight",
    ):
        assert name in text, name
    ok = [line for line in text.splitlines() if line.startswith('vericache_requests_total{status="ok"}')]
    assert ok and float(ok[0].split()[-1]) >= 1


class _CharTokenizer:
    def decode(self, tokens, skip_special_tokens=True):
        return "".join(chr(t) for t in tokens)


def test_text_deltas_hold_back_a_possible_stop_string():
    d = TextDeltas(_CharTokenizer(), ("END",))
    assert d.push([ord(c) for c in "abcE"]) == "ab"  # "cE" could begin "END"
    assert d.push([ord("N")]) == "c"
    assert d.finish("abc") == ""  # the stop string matched: the final text stops before it
    d = TextDeltas(_CharTokenizer(), ())
    assert d.push([ord("x"), ord("y")]) == "xy" and d.finish("xyz") == "z"
