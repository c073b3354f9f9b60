"""Both endpoints of ``vericache serve`` against bad input: every field with a wrong type, an out of
range or non-finite value, fields the server does not implement yet, unknown fields, oversized and
malformed bodies. Each is a 4xx whose error names the field; none is a 5xx; the server answers
correctly after."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from vericache_sglang.serve.openai_api import REFUSED, create_app
from vericache_sglang.serve.service import EngineService, Limits

pytestmark = pytest.mark.real_model

MAX_BODY = 1 << 20
NAN, INF = float("nan"), float("inf")


@pytest.fixture(scope="module")
def client(real_engine):
    service = EngineService(
        real_engine,
        "snapkv:ratio=0.25",
        horizon=8,
        limits=Limits(max_prompt_tokens=2048, max_new_tokens=64, max_concurrency=4),
    )
    service.start()
    with TestClient(create_app(service, "smollm2", max_body_bytes=MAX_BODY)) as c:
        yield c
    service.stop()


# field -> bad values, for both endpoints
COMMON = {
    "max_tokens": ["ten", -1, 0, 1.5, 10**6, [4]],
    "temperature": ["hot", -0.5, 2.5, NAN, INF, None, [1]],
    "top_p": [0, 1.5, NAN, "all"],
    "top_k": [-1, "five", 2.5],
    "seed": [-1, "x", 2**64, 1.5],
    "stop": [5, [1, 2], ["a"] * 17, {"s": 1}],
    "stream": ["yes", 2, None],
    "stream_options": ["x", {"bogus": 1}, {"include_usage": "x"}],
    "n": [0, 2, "x"],
    "user": [5, "u" * 300],
    "model": [5, "another-model"],
    "presence_penalty": [0.5, 5, NAN],
    "frequency_penalty": [0.5, -5, INF],
    "logit_bias": [{"5": 1.0}, "x"],
    "response_format": [{"type": "xml"}, {"type": "json_schema"}, {"type": "regex", "regex": "("}, "json"],
    "tools": ["x", [{"type": "function"}], [{"type": "function", "function": {"name": "f", "parameters": "x"}}]],
    "tool_choice": ["required", 5],  # without tools
    "parallel_tool_calls": [True, "x"],  # without tools
    "vericache": [{"compressor": "zipper"}, {"horizon": 0}, {"horizon": "x"}, {"bogus": 1}, "x"],
    "bogus_field": [1, "x"],
}
ENDPOINTS = {
    "/v1/completions": (
        {"prompt": "Hello", "max_tokens": 4, "temperature": 0},
        {
            **COMMON,
            "prompt": [5, [], "", [-1], [10**9], [1.5]],
            "logprobs": [2, -1, "x"],
            "echo": [True, "x"],
            "best_of": [2, 0],
            "suffix": ["after", 5],
        },
    ),
    "/v1/chat/completions": (
        {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4, "temperature": 0},
        {
            **COMMON,
            "messages": [
                [],
                "x",
                [{"role": "wizard", "content": "x"}],
                [{"role": "user", "content": 5}],
                [{"role": "tool", "content": "x"}],  # no tool_call_id
                [{"role": "user", "content": "x", "bogus": 1}],
            ],
            "max_completion_tokens": [0, "x"],
            "logprobs": ["x", 3],
            "top_logprobs": [1, 50, -1],
        },
    ),
}


def _cases():
    for path, (base, fields) in ENDPOINTS.items():
        for field, values in fields.items():
            for value in values:
                yield pytest.param(path, base, field, value, id=f"{path.split('/')[-1]}-{field}-{value!r:.30}")


@pytest.mark.parametrize(("path", "base", "field", "value"), list(_cases()))
def test_a_bad_field_is_a_4xx_that_names_it(client, path, base, field, value):
    body = json.dumps({**base, field: value})  # NaN and Infinity as JSON's extension literals
    r = client.post(path, content=body, headers={"Content-Type": "application/json"})
    assert 400 <= r.status_code < 500, (field, value, r.status_code, r.text[:300])
    error = r.json()["error"]
    named = field.split("_field")[0] if field == "bogus_field" else field
    assert named in json.dumps(error), (field, value, error)


def test_refused_fields_are_the_ones_listed(client):
    r = client.post(
        "/v1/chat/completions",
        json={
            **ENDPOINTS["/v1/chat/completions"][0],
            "frequency_penalty": 0.0,
            "presence_penalty": 0.0,
            "user": "u-1",
            "stream_options": None,
        },
    )
    assert r.status_code == 200, r.text  # neutral values of refused fields are accepted
    assert set(REFUSED) >= {"presence_penalty", "frequency_penalty", "logit_bias", "top_logprobs"}


@pytest.mark.parametrize("path", list(ENDPOINTS))
def test_oversized_and_malformed_bodies(client, path):
    huge = json.dumps({**ENDPOINTS[path][0], "padding": "x" * (MAX_BODY + 1)})
    r = client.post(path, content=huge, headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and "body" in r.json()["error"]["param"], r.text[:300]

    def chunks():
        yield b'{"prompt": "'
        for _ in range(MAX_BODY // 65536 + 2):
            yield b"x" * 65536
        yield b'"}'

    r = client.post(path, content=chunks(), headers={"Content-Type": "application/json"})  # no Content-Length
    assert r.status_code == 413, r.text[:300]
    for bad in (b"{", b"[]", b"null", b'{"messages": '):
        r = client.post(path, content=bad, headers={"Content-Type": "application/json"})
        assert 400 <= r.status_code < 500, (bad, r.status_code)


def test_the_server_answers_correctly_after(client, real_engine):
    tokens = real_engine.encode("Name three colours.")
    ref = real_engine.generate(
        real_engine.prefill(tokens, reuse_prefix=False), "full", cfg=real_engine.config(max_new_tokens=12)
    )
    r = client.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "Name three colours."}], "max_tokens": 12, "temperature": 0},
    )
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == ref.text
