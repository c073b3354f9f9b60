"""Shared documents through the server, on SmolLM2: a document registered over HTTP (rendered as its
chat-template segment), chat requests that start with it skip their prefill and draft over its
KVzip copy, with outputs identical to full-KV decoding of the whole prompt from scratch."""

import pytest
from conftest import PROMPTS
from fastapi.testclient import TestClient

from vericache_sglang.core.compress import parse_spec
from vericache_sglang.engine.prefix import PrefixRegistry, document_tokens
from vericache_sglang.serve.openai_api import create_app
from vericache_sglang.serve.service import EngineService, Limits

pytestmark = pytest.mark.real_model

NEW = 24
QUESTIONS = ["Summarise the passage in one sentence.", "What is the second paragraph about?"]


@pytest.fixture(scope="module")
def document(real_engine):
    text = (PROMPTS / "prose.txt").read_text().rsplit("\n\n", 1)[0]
    ids = real_engine.tokenizer(text, add_special_tokens=False)["input_ids"][:700]
    return real_engine.tokenizer.decode(ids)


@pytest.fixture(scope="module")
def client(real_engine):
    registry = PrefixRegistry(real_engine.runner, real_engine.store, parse_spec("kvzip:ratio=0.25"))
    svc = EngineService(
        real_engine,
        "snapkv:ratio=0.25",
        horizon=8,
        limits=Limits(max_prompt_tokens=4096),
        prefixes=registry,
        prefix_refresh_s=0.0,
    )
    svc.start()
    with TestClient(create_app(svc, "smollm2")) as c:
        yield c
    svc.stop()


def test_document_segment_aligns_with_chat_prompts(real_engine, document):
    seg = document_tokens(real_engine.tokenizer, document)
    chat = real_engine.tokenizer.apply_chat_template(
        [{"role": "system", "content": document}, {"role": "user", "content": QUESTIONS[0]}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
    )["input_ids"]
    assert list(chat[: len(seg)]) == seg


def test_chat_over_a_registered_document_is_identical_to_full_kv(client, real_engine, document, exactness):
    r = client.post("/v1/prefixes", json={"text": document, "name": "prose"})
    assert r.status_code == 200, r.text
    doc = r.json()
    chunk = real_engine.store.chunk_tokens
    assert doc["tokens"] == doc["submitted_tokens"] - doc["submitted_tokens"] % chunk > 0
    assert doc["compressor"].startswith("kvzip")
    for i, q in enumerate(QUESTIONS):
        messages = [{"role": "system", "content": document}, {"role": "user", "content": q}]
        # the server's own check once: the test's reference below decodes the same full KV
        r = client.post(
            "/v1/chat/completions",
            json={
                "messages": messages,
                "max_tokens": NEW,
                "temperature": 0,
                "logprobs": True,
                "vericache": {"check": i == 0},
            },
        )
        assert r.status_code == 200, r.text
        body = r.json()
        v = body["vericache"]
        assert (v["document"], v["prefix_tokens"]) == ("prose", doc["tokens"])
        tokens = real_engine.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
        pre = real_engine.prefill(tokens, reuse_prefix=False)  # full KV of the whole prompt, from scratch
        ref = real_engine.generate(pre, "full", cfg=real_engine.config(max_new_tokens=NEW, logprobs=True))
        got = body["choices"][0]["logprobs"]["content"]
        ids = [c["token_id"] for c in got]
        mismatch = next((i for i, (a, b) in enumerate(zip(ids, ref.tokens, strict=False)) if a != b), None)
        identical = ids == ref.tokens and body["choices"][0]["message"]["content"] == ref.text
        diff = max(abs(c["logprob"] - lp) for c, lp in zip(got, ref.logprobs, strict=False))
        exactness(
            f"SmolLM2 server chat over a kvzip document ({doc['tokens']} tok)",
            {
                "identical": identical,
                "first_mismatch": mismatch,
                "compared_tokens": len(ids),
                "max_logit_abs_diff": None,
            },
            max_logprob_abs_diff=diff,
            mean_accepted_length=v["mean_accepted_length"],
        )
        assert identical, (body["choices"][0]["message"]["content"], ref.text)
        if i == 0:
            check = v["check"]  # the server's own comparison agrees
            assert check["identical"] and check["compared_tokens"] == NEW and check["max_logit_abs_diff"] < 1e-3
    listed = client.get("/v1/prefixes").json()["data"]
    assert [(d["name"], d["hits"]) for d in listed] == [("prose", 2)]
    metrics = client.get("/metrics").text
    assert "vericache_prefix_hits_total 2.0" in metrics and "vericache_documents 1.0" in metrics
    assert 'vericache_checks_total{result="identical"} 1.0' in metrics
    # a request that names its own compressor is prefilled as usual
    messages = [{"role": "system", "content": document}, {"role": "user", "content": QUESTIONS[0]}]
    r = client.post(
        "/v1/chat/completions",
        json={"messages": messages, "max_tokens": 4, "temperature": 0, "vericache": {"compressor": "knorm:ratio=0.5"}},
    )
    assert r.status_code == 200 and r.json()["vericache"]["prefix_tokens"] == 0
    # removed: unlisted from the store's catalog, the copy dropped, requests prefilled again
    r = client.delete(f"/v1/prefixes/{doc['digest']}")
    assert r.status_code == 200 and client.get("/v1/prefixes").json()["data"] == []
    assert client.delete(f"/v1/prefixes/{doc['digest']}").status_code == 404
    r = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200 and r.json()["vericache"]["prefix_tokens"] == 0


@pytest.mark.parametrize(
    "body,fragment",
    [
        ({"text": "too short"}, "at least one store chunk"),
        ({}, "one of them"),
        ({"text": "x", "token_ids": [1]}, "one of them"),
        ({"token_ids": [10**9] * 80}, "token ids must be in"),
        ({"text": "x" * 400, "role": "tool"}, "system, user or raw"),
    ],
)
def test_bad_documents_are_clear_400s(client, body, fragment):
    r = client.post("/v1/prefixes", json=body)
    assert r.status_code == 400 and fragment in r.json()["error"]["message"], r.text


def test_prefix_cli_against_a_shared_store(redis_url, document, tmp_path):
    """`vericache prefix add/list/remove --store`: separate processes, one real Redis between them."""
    import json
    import subprocess
    import sys
    import uuid

    ns = uuid.uuid4().hex[:8]
    doc = tmp_path / "doc.txt"
    doc.write_text(document)

    def cli(*args):
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "vericache_sglang.cli",
                "prefix",
                *args,
                "--store",
                redis_url,
                "--store-namespace",
                ns,
                "--json",
            ],
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        return json.loads(done.stdout)

    added = cli("add", str(doc), "--name", "from-cli")
    assert added["name"] == "from-cli" and added["tokens"] > 0 and added["tokens"] % 64 == 0
    [listed] = cli("list")
    assert (listed["digest"], listed["tokens"]) == (added["digest"], added["tokens"])
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "vericache_sglang.cli",
            "prefix",
            "remove",
            added["digest"],
            "--store",
            redis_url,
            "--store-namespace",
            ns,
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0 and cli("list") == []
