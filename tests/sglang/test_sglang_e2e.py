"""SGLang end to end on this CPU: real ``sglang.launch_server`` processes, the official ``openai``
client, SmolLM2 in float32; the session's ``--enable-vericache`` server (``sglang_e2e.MODIFIERS``:
SnapKV at 1/16 with both drafting modifiers, the full KV on the device) held token for token to
stock SGLang on the same requests. The plain draft loop (no lookup) with the full KV in the store
or the host pool: ``tests/sglang/test_sglang_e2e_modes.py``.

Stock SGLang is pinned to the project's own full-KV decoding first: that is what makes "identical
to stock" mean "identical to full-KV decoding" here.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
from sglang_e2e import COPY, PERSON_FORMAT, compare_answers, prompt, same_as_stock, seeded_as_full_kv_sampling

from vericache_sglang.bench.sglang_server import Ask, accepted_length, ask, ask_all, metric_growth

pytestmark = [pytest.mark.real_model, pytest.mark.sglang]


@pytest.fixture(scope="module")
def vericache(vericache_launch):
    vericache_launch.wait_healthy()
    yield vericache_launch
    # its memory back before the next modules' servers start: SGLang's host pool (full_kv "host")
    # asks for 10 GiB of free host memory beside itself
    vericache_launch.stop()


def test_stock_sglang_decodes_as_the_projects_full_kv_decoding(stock_server, real_engine, exactness):
    """The platform layer: stock SGLang on this CPU, through the openai client, is the project's
    own full-KV greedy decoding of a real 1,000-token prompt."""
    text = prompt("prose")
    tokens = real_engine.encode(text)
    assert len(tokens) >= 1000
    ref = real_engine.generate(
        real_engine.prefill(tokens, reuse_prefix=False),
        "full",
        cfg=real_engine.config(max_new_tokens=16, keep_logits=True),
    )
    out = ask(stock_server, Ask(text, "chat", max_tokens=16, params={"logprobs": True}))
    assert out.text == ref.text
    engine_logprobs = [float(lg.float().log_softmax(-1)[t]) for lg, t in zip(ref.logits, ref.tokens, strict=True)]
    n = min(len(engine_logprobs), len(out.logprobs))
    diff = max(abs(a - b) for a, b in zip(engine_logprobs[:n], out.logprobs[:n], strict=True))
    exactness(
        "stock sglang vs engine full-KV (prose, chat)",
        {"identical": True, "compared_tokens": n, "max_logprob_abs_diff": diff},
    )
    assert diff < 1e-3


def test_completions_and_chat_streamed_and_not_are_stocks_output(stock_server, vericache, exactness):
    questions = [
        Ask(prompt("prose"), "completion", max_tokens=24, params={"logprobs": 1}),
        Ask(COPY + prompt("code", 300), "completion", stream=True, max_tokens=32),  # copy-heavy: lookup drafts
        Ask(prompt("tools"), "chat", max_tokens=24, params={"logprobs": True}),
        Ask(prompt("prose"), "chat", stream=True, max_tokens=24),
    ]
    _, got = same_as_stock(stock_server, vericache, questions, exactness, "snapkv+refresh+lookup")
    assert all(len(a.text) > 0 for a in got)
    assert sum(a.finish_reason == "length" for a in got) >= 2  # at least two ran their whole budget
    assert accepted_length(vericache.metrics()) > 2


def test_eight_concurrent_requests_some_stopping_early(stock_server, vericache, exactness):
    questions = [
        Ask(prompt("prose"), "chat", max_tokens=32),
        Ask(prompt("code"), "completion", max_tokens=32, params={"stop": ["\n\n"]}),
        Ask(prompt("tools", 1200), "chat", max_tokens=24),
        Ask("The capital of France is", "completion", max_tokens=30, params={"stop": ["."]}),
        Ask("List three colours, one per line.", "chat", max_tokens=24),
        Ask("def quicksort(arr):", "completion", max_tokens=32, params={"stop": ["\ndef "]}),
        Ask(prompt("prose", 1400), "completion", max_tokens=16),
        Ask("Say hello.", "chat", max_tokens=32),
    ]
    expected, _ = same_as_stock(stock_server, vericache, questions, exactness, "concurrent")
    early = [a for q, a in zip(questions, expected, strict=True) if a.finish_reason == "stop"]
    assert len(early) >= 2  # stop strings and EOS ended some before their budget


def test_a_shared_document_prefix_is_cached_and_drafted_from_its_compressed_copy(stock_server, vericache, exactness):
    """RadixAttention: requests whose prompts share a 1,200-token document. SGLang reports the
    cached prefix for the later ones; the first of them makes the prefix's compressed copy, the next
    drafts over it; every answer is stock SGLang's."""
    document = prompt("prose", 1200)
    questions = [
        Ask("What is a block?", "chat", max_tokens=16, system=document),
        Ask("What does the global statement change?", "chat", max_tokens=16, system=document),
        Ask("How is a name resolved?", "chat", max_tokens=16, system=document),
    ]
    before = vericache.metrics()
    for i, q in enumerate(questions):
        ref, out = ask(stock_server, q), ask(vericache, q)
        cmp = compare_answers(ref, out)
        exactness(f"sglang radix prefix, question {i + 1}", cmp)
        assert cmp["identical"], (ref.text, out.text)
        if i > 0:
            assert ref.cached_tokens >= 1100 and out.cached_tokens >= 1100 - 64, (ref.cached_tokens, out.cached_tokens)
    after = vericache.metrics()
    assert metric_growth(after, before, "vericache_prefix_copies_made_total") == 1
    assert metric_growth(after, before, "vericache_prefix_copy_hits_total") >= 1


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "languages": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3},
    },
    "required": ["name", "age", "languages"],
    "additionalProperties": False,
}


def test_a_json_schema_and_a_frequency_penalty_in_a_batch_with_plain_requests(stock_server, vericache, exactness):
    schema_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    questions = [
        Ask(
            "Describe Ada Lovelace as a JSON object with her name, age and languages.",
            "chat",
            max_tokens=160,
            params={"response_format": schema_format},
        ),
        Ask(prompt("prose"), "completion", max_tokens=24, params={"frequency_penalty": 0.8}),
        Ask("def fibonacci(n):", "completion", max_tokens=24),
        Ask(prompt("code"), "chat", max_tokens=16),
    ]
    before = vericache.metrics()
    _, got = same_as_stock(stock_server, vericache, questions, exactness, "grammar+penalty batch")
    assert got[0].finish_reason == "stop", got[0].text  # the grammar completed, not the budget
    jsonschema.validate(json.loads(got[0].text), PERSON)
    assert vericache.metrics()["vericache_verify_passes_total"] > before["vericache_verify_passes_total"]


CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 30}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": name, "description": f"Current {what} in a city", "parameters": CITY}}
    for name, what in (("get_weather", "weather"), ("get_time", "time"))
]


NAMED = {"type": "function", "function": {"name": "get_time"}}


@pytest.mark.parametrize("choice", ["required", pytest.param(NAMED, marks=pytest.mark.slow, id="named")])
def test_tool_calls_through_sglangs_own_grammar_and_parser_are_stocks(stock_server, vericache, choice):
    """SGLang turns tool_choice "required" or a named function into a grammar (the worker masks
    drafts and verification with it) and parses the answer with its own tool-call parser: the
    VeriCache server's tool calls are stock SGLang's."""

    def call(server):
        r = server.client().chat.completions.create(
            model="default",
            messages=[{"role": "user", "content": "What is the weather in Paris?"}],
            tools=TOOLS,
            tool_choice=choice,
            max_tokens=48,
            temperature=0,
        )
        message = r.choices[0].message
        return (
            r.choices[0].finish_reason,
            message.content,
            [(t.function.name, t.function.arguments) for t in message.tool_calls or []],
        )

    expected, got = call(stock_server), call(vericache)
    assert got == expected
    assert got[2]  # a tool call was made and parsed


def test_seeded_sampling_is_the_same_across_runs_and_batches_and_is_full_kv_sampling(vericache, real_engine, exactness):
    """The core's position-keyed sampler draws every token, so a seeded request's text depends on
    nothing but its seed and its logits: not on the run, not on its batch, and it is what the
    project's full-KV decoding samples with the same seed."""
    text = "Write a short story about a lighthouse keeper who finds a message in a bottle."
    params = {"temperature": 0.8, "top_p": 0.95, "seed": 11}
    q = Ask(text, "chat", max_tokens=24, params=params)
    alone = ask(vericache, q).text
    batched = ask_all(
        vericache,
        [
            q,
            Ask(prompt("code"), "completion", max_tokens=16),
            Ask("Name a colour.", "chat", max_tokens=16, params={"temperature": 0.7, "seed": 3}),
        ],
    )
    assert alone == batched[0].text  # a second run, in a batch
    ref_text = seeded_as_full_kv_sampling(
        vericache, real_engine, text, 24, exactness, "sglang seeded sampling vs engine full-KV sampling"
    )
    assert ref_text == alone


def test_lookup_chains_under_a_json_schema(stock_server, vericache, exactness):
    """The object to write is in the prompt, with a property the schema forbids: the lookup window
    walks the grammar (chains stop before a forbidden token) and the answer is stock's."""
    text = (
        'Here is a record: {"name": "Ada Lovelace", "age": 36, "city": "London"}\n'
        "Write it as a JSON object with only her name and age."
    )
    before = vericache.metrics()
    _, got = same_as_stock(
        stock_server,
        vericache,
        [Ask(text, "chat", max_tokens=48, params={"response_format": PERSON_FORMAT})],
        exactness,
        "refresh+lookup json schema, lookup under the grammar",
    )
    assert json.loads(got[0].text) == {"name": "Ada Lovelace", "age": 36}, got[0].text
    assert metric_growth(vericache.metrics(), before, "vericache_lookup_drafted_tokens_total") > 0


def test_sglangs_metrics_carry_the_vericache_series_from_real_steps(vericache):
    """After this module's requests: the series are SGLang's /metrics', and they show what the
    server's configuration does (the drafting modifiers, the full KV on the device)."""
    m = vericache.metrics()
    for name in (
        "vericache_verify_passes_total",
        "vericache_generated_tokens_total",
        "vericache_drafted_tokens_total",
        "vericache_accepted_length_count",
        "vericache_step_seconds_count",
    ):
        assert m.get(name, 0) > 0, name
    assert m["vericache_compressed_kv_bytes"] >= 0
    assert "sglang:num_running_reqs" in m  # served by SGLang's own /metrics, next to its series
    # full_kv "device": nothing left the device, nothing was fetched
    assert m["vericache_full_kv_written_bytes_total"] == 0 and m["vericache_full_kv_fetched_bytes_total"] == 0
    assert m["vericache_store_errors_total"] == 0 and m["vericache_full_kv_recomputes_total"] == 0
    # +refresh: at most one refresh per verification; +lookup: chains drafted, each checked in one
    # pass, so fewer draft passes than drafts (a pass serves the whole batch)
    assert 0 < m["vericache_refreshes_total"] <= m["vericache_verify_passes_total"]
    assert m["vericache_lookup_drafted_tokens_total"] > 0
    assert m["vericache_draft_passes_total"] < m["vericache_drafted_tokens_total"]
