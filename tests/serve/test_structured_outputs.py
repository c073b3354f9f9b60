"""Structured outputs with VeriCache, lossless: a grammar's token masks (xgrammar) applied alike to
drafts and to the verification, the matcher rolled back past rejected drafts; VeriCache's output is
full-KV constrained decoding's, token for token, greedy and seeded, on SmolLM2. Through the engine
and through ``vericache serve`` with the official openai client."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
from conftest import PROMPTS

from vericache_sglang.core.compress import RECOMMENDED
from vericache_sglang.core.sampling import SamplingParams
from vericache_sglang.engine.constraint import ConstraintCompiler, ConstraintError
from vericache_sglang.engine.engine import compare

pytestmark = pytest.mark.real_model

CALL = {
    "type": "object",
    "properties": {"tool": {"type": "string", "maxLength": 40}, "arguments": {"type": "object"}},
    "required": ["tool", "arguments"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "call", "schema": CALL}}
SAMPLED = SamplingParams(temperature=0.8, top_p=0.95, seed=7)
ID = {"type": "string", "maxLength": 12}
REFUND = {
    "type": "object",
    "properties": {
        "tool": {"enum": ["create_refund", "search_orders"]},
        "arguments": {
            "type": "object",
            "properties": {"order_id": ID, "customer_id": ID},
            "required": ["order_id", "customer_id"],
            "additionalProperties": False,
        },
    },
    "required": ["tool", "arguments"],
    "additionalProperties": False,
}


def _check(
    real_engine, exactness, name: str, sampling: SamplingParams, new: int = 64, spec: str = "snapkv:ratio=0.125"
):
    constraint = real_engine.constraint(FORMAT)
    pre = real_engine.prefill(real_engine.encode((PROMPTS / f"{name}.txt").read_text()), reuse_prefix=False)
    cfg = real_engine.config(max_new_tokens=new, horizon=16, keep_logits=True, constraint=constraint, sampling=sampling)
    ref = real_engine.generate(pre, "full", cfg=cfg)
    out = real_engine.generate(pre, "vericache", spec, cfg=cfg)
    cmp = compare(ref, out)
    label = "greedy" if sampling.greedy else "T=0.8"
    exactness(f"SmolLM2 json_schema {name} {label} {spec}", cmp, mean_accepted_length=out.stats.mean_accepted_length)
    assert cmp["identical"], (ref.text, out.text)
    assert out.text.startswith("{")
    if out.finish_reason == "stop":
        jsonschema.validate(json.loads(out.text), CALL)
    return out


# greedy in the default set: the same check on the tools prompt with the recommended spec (below)
@pytest.mark.parametrize(
    "sampling", [pytest.param(SamplingParams(), marks=pytest.mark.slow), SAMPLED], ids=["greedy", "sampled"]
)
def test_a_json_schema_on_the_prose_prompt_is_full_kv_constrained_decoding(real_engine, exactness, sampling):
    _check(real_engine, exactness, "prose", sampling)


@pytest.mark.parametrize(
    "sampling", [SamplingParams(), pytest.param(SAMPLED, marks=pytest.mark.slow)], ids=["greedy", "sampled"]
)
def test_prompt_lookup_chains_under_a_grammar_are_full_kv_constrained_decoding(real_engine, exactness, sampling):
    """Lookup chains stop where the grammar forbids a token; the masks drafting used are the
    verification's. The tools prompt's calls recur, so chains are drafted."""
    out = _check(real_engine, exactness, "tools", sampling, new=96, spec=RECOMMENDED)
    assert out.stats.lookup_drafted > 0


def test_a_bitmask_allows_exactly_the_tokens_it_leaves_finite(real_engine):
    state = real_engine.constraint(FORMAT).state()
    state.advance(real_engine.tokenizer.encode("{", add_special_tokens=False)[0])
    mask = state.mask()
    finite = state.apply(torch.zeros(1, real_engine.runner.vocab_size), mask)[0].isfinite()
    assert 0 < int(finite.sum()) < finite.numel()
    assert [state.allows(t, mask) for t in range(finite.numel())] == finite.tolist()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["code", "tools"])
@pytest.mark.parametrize("sampling", [SamplingParams(), SAMPLED], ids=["greedy", "sampled"])
def test_a_json_schema_on_every_real_prompt(real_engine, exactness, name, sampling):
    _check(real_engine, exactness, name, sampling, new=256)


def test_formats_that_cannot_be_compiled_say_why(real_engine):
    for bad, message in [
        ({"type": "json_schema", "json_schema": {}}, "schema must be a JSON Schema object"),
        ({"type": "xml"}, "not one of json_object, json_schema, regex, ebnf"),
        ({"type": "regex", "regex": "("}, "response_format: "),
        ({"type": "ebnf", "ebnf": "root ::= "}, "response_format: "),
    ]:
        with pytest.raises(ConstraintError, match=message):
            real_engine.constraint(bad)


def test_the_compiled_grammar_cache_is_bounded(real_engine):
    """A server compiles every client's schema: its cache keeps what fits its limit, least recently
    used out first, instead of every distinct schema for the life of the process."""

    def schema(i: int) -> dict:
        props = {f"field_{i}_{j}": {"type": "string", "maxLength": 8 + j} for j in range(4)}
        return {
            "type": "json_schema",
            "json_schema": {"schema": {"type": "object", "properties": props, "required": list(props)}},
        }

    vocab = real_engine.runner.vocab_size
    unbounded = ConstraintCompiler(real_engine.tokenizer, vocab)
    unbounded.compile(schema(0))
    one = unbounded.cache_bytes()
    assert one > 0
    bounded = ConstraintCompiler(real_engine.tokenizer, vocab, cache_limit_bytes=3 * one)
    for i in range(1, 11):
        unbounded.compile(schema(i))
        bounded.compile(schema(i))
    assert unbounded.cache_bytes() >= 8 * one  # the default limit keeps them all
    assert bounded.cache_bytes() <= 3.5 * one  # xgrammar may pass its limit by a little
    with pytest.raises(ValueError, match="cache_limit_bytes"):
        ConstraintCompiler(real_engine.tokenizer, vocab, cache_limit_bytes=0)


@pytest.fixture(scope="module")
def server(real_engine):
    import threading

    import uvicorn
    from services import free_port

    from vericache_sglang.serve.openai_api import create_app
    from vericache_sglang.serve.service import EngineService, Limits

    service = EngineService(
        real_engine,
        "snapkv:ratio=0.125",
        horizon=16,
        limits=Limits(max_prompt_tokens=4096, max_new_tokens=256, max_concurrency=4),
    )
    service.start()
    port = free_port()
    web = uvicorn.Server(
        uvicorn.Config(create_app(service, "smollm2"), host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=web.run, daemon=True)
    thread.start()
    while not web.started:
        thread.join(0.05)
    yield f"http://127.0.0.1:{port}/v1"
    web.should_exit = True
    thread.join(30)
    service.stop()


# seeded sampling under a schema in the default set: the tool call below and the prose schema above
@pytest.mark.parametrize(
    "params",
    [{"temperature": 0}, pytest.param({"temperature": 0.8, "top_p": 0.95, "seed": 7}, marks=pytest.mark.slow)],
    ids=["greedy", "sampled"],
)
def test_response_format_through_the_openai_client(server, exactness, params):
    from openai import OpenAI

    client = OpenAI(base_url=server, api_key="none", max_retries=0, timeout=600)
    refund = {"type": "json_schema", "json_schema": {"name": "refund", "schema": REFUND}}
    r = client.chat.completions.create(
        model="smollm2",
        max_tokens=96,
        response_format=refund,
        extra_body={"vericache": {"check": True}},
        messages=[{"role": "user", "content": "Call the tool that refunds order O-1 for customer C-9, as JSON."}],
        **params,
    )
    check = r.model_extra["vericache"]["check"]
    exactness(f"SmolLM2 server response_format {'greedy' if params['temperature'] == 0 else 'T=0.8'}", check)
    assert check["identical"], check
    assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
    jsonschema.validate(json.loads(r.choices[0].message.content), REFUND)
    r = client.chat.completions.create(
        model="smollm2",
        max_tokens=64,
        response_format={"type": "json_object"},
        messages=[{"role": "user", "content": "Three colours as JSON."}],
        **params,
    )
    if r.choices[0].finish_reason == "stop":
        json.loads(r.choices[0].message.content)  # any JSON


CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 30}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Current weather in a city", "parameters": CITY},
    },
    {"type": "function", "function": {"name": "get_time", "description": "Current time in a city", "parameters": CITY}},
]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


# greedy under a grammar through the client in the default set: the response_format case above
@pytest.mark.parametrize(
    "params",
    [pytest.param({"temperature": 0}, marks=pytest.mark.slow), {"temperature": 0.8, "top_p": 0.95, "seed": 7}],
    ids=["greedy", "sampled"],
)
def test_a_required_tool_call_is_full_kv_decodings_and_parses_into_tool_calls(server, exactness, params):
    """tool_choice "required" constrains the answer to SmolLM2's call list (the grammar of the
    tools' parameters); the answer is parsed into OpenAI tool_calls whose arguments fit them."""
    from openai import OpenAI

    client = OpenAI(base_url=server, api_key="none", max_retries=0, timeout=600)
    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        r = client.chat.completions.create(
            model="smollm2",
            messages=ASK,
            tools=TOOLS,
            tool_choice=choice,
            max_tokens=80,
            extra_body={"vericache": {"check": True}},
            **params,
        )
        check = r.model_extra["vericache"]["check"]
        label = "greedy" if params["temperature"] == 0 else "T=0.8"
        exactness(f"SmolLM2 server tool call {choice if isinstance(choice, str) else 'named'} {label}", check)
        assert check["identical"], check
        choice0 = r.choices[0]
        assert choice0.finish_reason == "tool_calls" and choice0.message.tool_calls, choice0
        for call in choice0.message.tool_calls:
            assert call.function.name in ("get_weather", "get_time")
            if isinstance(choice, dict):
                assert call.function.name == "get_time"
            jsonschema.validate(json.loads(call.function.arguments), CITY)


def test_a_conversation_with_a_tool_turn_answers(server):
    from openai import OpenAI

    client = OpenAI(base_url=server, api_key="none", max_retries=0, timeout=600)
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})},
    }
    r = client.chat.completions.create(
        model="smollm2",
        tools=TOOLS,
        max_tokens=40,
        temperature=0,
        messages=[
            *ASK,
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": json.dumps({"temperature_c": 18, "sky": "clear"})},
        ],
    )
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.content


def test_a_model_without_a_known_tool_format_is_refused():
    from vericache_sglang.serve.tools import ToolError, required_function, tool_format

    assert (
        tool_format("{% for m in messages %}You are a helpful AI assistant named SmolLM{% endfor %}").name == "smollm2"
    )
    with pytest.raises(ToolError, match="no tool-call format this server knows"):
        tool_format("{% for m in messages %}[INST] {{ m.content }} [/INST]{% endfor %}")
    with pytest.raises(ToolError, match="not among the tools"):
        required_function(TOOLS, {"type": "function", "function": {"name": "launch"}})
