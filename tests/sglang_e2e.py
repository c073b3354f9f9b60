"""What the SGLang end-to-end tests compare; their requests go through the official ``openai``
client (``vericache_sglang.bench.sglang_server.ask``). Every "identical" is the VeriCache server's
output against stock SGLang's on the same request, token text for token text; where
log-probabilities are asked for, their largest difference is recorded (``exactness``)."""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from vericache_sglang.bench.sglang_server import Answer, Ask, SGLangServer, ask_all, document_prompt, tokenizer

# the drafting modifiers as the e2e tests run them (small budgets: a 1,000-token prompt keeps 64 rows)
MODIFIERS = {"compressor": "snapkv:ratio=0.0625+refresh:ratio=0.0625,span=4+lookup", "horizon": 8, "full_kv": "device"}
COPY = "Repeat the following code exactly, then stop.\n\n"  # a copy-heavy prompt's opening
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
PERSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}


def store_mode_config(store_url: str) -> dict:
    """The default set's ``full_kv: "store"`` server (``conftest.store_mode_launch``): SnapKV at 1/8,
    the plain draft loop, each request's full KV only in our gRPC store between verifications."""
    return {
        "compressor": "snapkv:ratio=0.125",
        "horizon": 8,
        "full_kv": "store",
        "store": store_url,
        "reload_room": 0.2,
    }


def bytes_are_the_requests_full_kv(before: dict, after: dict, got, horizon: int, published: bool = False) -> None:
    """One request alone on the server, over a stored prefix its tree now holds: its own positions
    (the prompt past that prefix, then what it committed) were written to the store once each; the
    prefix left the device with it (unpinned from the tree, counted as streamed), so each
    verification fetched its whole context written by then, prefix included, as whole tokens of
    SmolLM2's full KV. The last verification may commit up to ``horizon`` tokens past
    ``max_tokens``: SGLang trims them from the answer after their KV has left the device. With
    ``published`` (HiCache on) the whole prompt went into the radix tree after prefill, so only
    committed tokens are the request's own."""
    from transformers import AutoConfig

    from vericache_sglang.engine.model import smollm2_dir

    config = AutoConfig.from_pretrained(smollm2_dir())
    per_token = config.num_hidden_layers * 2 * config.num_key_value_heads * config.head_dim * 4  # float32
    grown = {k: after[k] - before.get(k, 0.0) for k in after}
    written, fetched = grown["vericache_full_kv_written_bytes_total"], grown["vericache_full_kv_fetched_bytes_total"]
    verifications = grown["vericache_verify_passes_total"]
    assert written % per_token == 0 and fetched % per_token == 0, (written, fetched, per_token)
    own = 0 if published else got.prompt_tokens - got.cached_tokens
    most = own + got.completion_tokens
    assert own <= written // per_token <= most + horizon, (written // per_token, own, most)
    assert grown["vericache_store_prefixes_streamed_total"] == 1, {k: v for k, v in grown.items() if v}
    assert verifications >= 1
    whole, longest = got.prompt_tokens, got.prompt_tokens + got.completion_tokens + horizon
    assert verifications * whole <= fetched // per_token <= verifications * longest, (fetched // per_token, whole)


@contextlib.contextmanager
def stock_and_vericache(
    logs: Path, name: str, args: tuple[str, ...], vericache: dict, env: dict[str, str] | None = None
) -> Iterator[tuple[SGLangServer, SGLangServer]]:
    """A stock server and a VeriCache one with the same ``args``, loaded side by side; both
    stopped after."""
    stock = SGLangServer(logs, f"stock-{name}", *args, env=env, wait=False)
    ours = SGLangServer(logs, f"vericache-{name}", *args, env=env, vericache=vericache, wait=False)
    try:
        stock.wait_healthy()
        ours.wait_healthy()
        yield stock, ours
    finally:
        stock.stop()
        ours.stop()


def same_as_stock(
    stock: Any, server: Any, questions: list[Ask], exactness: Any, name: str
) -> tuple[list[Answer], list[Answer]]:
    """Ask ``stock`` and ``server`` the same ``questions`` (each a batch); every answer must be
    stock's, each recorded in ``exactness``. Returns both servers' answers. Both are asked at once:
    one server's gaps (HTTP, tokenizer, detokenizer) are the other's compute."""
    with cf.ThreadPoolExecutor(2) as pool:
        ours = pool.submit(ask_all, server, questions)
        expected, got = stock_answers(stock, questions), ours.result()
    for q, ref, out in zip(questions, expected, got, strict=True):
        cmp = compare_answers(ref, out)
        exactness(f"sglang {name} {q.label()}", cmp)
        assert cmp["identical"], (name, q.label(), ref.text, out.text)
    return expected, got


_STOCK: dict[tuple[str, str], list[Answer]] = {}


def stock_answers(stock: Any, questions: list[Ask]) -> list[Answer]:
    """Stock SGLang's answers to ``questions`` asked as one batch, once per test session: several
    VeriCache servers are held to the same batch (each ``full_kv`` place), and stock's greedy and
    seeded answers to a batch do not change."""
    key = (stock.url, repr(questions))
    if key not in _STOCK:
        _STOCK[key] = ask_all(stock, questions)
    return _STOCK[key]


def compare_answers(reference: Answer, answer: Answer) -> dict[str, Any]:
    """The exactness record of one answer against stock SGLang's."""
    diff = None
    if reference.logprobs is not None and answer.logprobs is not None:
        n = min(len(reference.logprobs), len(answer.logprobs))
        diff = max((abs(a - b) for a, b in zip(reference.logprobs[:n], answer.logprobs[:n], strict=True)), default=0.0)
    return {
        "identical": reference.text == answer.text and reference.finish_reason == answer.finish_reason,
        "compared_tokens": token_count(answer.text),
        "max_logprob_abs_diff": diff,
        "first_mismatch": _first_difference(reference.text, answer.text),
    }


def _first_difference(a: str, b: str) -> int | None:
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
        None if len(a) == len(b) else min(len(a), len(b)),
    )


@functools.cache
def prompt(name: str, min_tokens: int = 1000) -> str:
    """``benchmarks/prompts/NAME.txt`` cut to about ``min_tokens`` tokens (a real prompt of >= 1,000)."""
    return document_prompt(name, min_tokens)


@functools.cache
def _tokenizer() -> Any:
    return tokenizer()


def token_count(text: str) -> int:
    return len(_tokenizer().encode(text, add_special_tokens=False))


def seeded_as_full_kv_sampling(server: Any, engine: Any, text: str, new_tokens: int, exactness: Any, name: str) -> str:
    """A seeded request (T=0.8, top-p 0.95, seed 11) on ``server``'s native ``/generate`` must draw
    the tokens the project's full-KV decoding samples with the same seed; recorded in ``exactness``.
    Returns the engine's text."""
    from vericache_sglang.core.sampling import SamplingParams

    tokens = engine.encode(text)
    ref = engine.generate(
        engine.prefill(tokens, reuse_prefix=False),
        "full",
        cfg=engine.config(max_new_tokens=new_tokens, sampling=SamplingParams(temperature=0.8, top_p=0.95, seed=11)),
    )
    out = server.generate(
        tokens, {"max_new_tokens": new_tokens, "temperature": 0.8, "top_p": 0.95, "sampling_seed": 11}
    )
    got = [t for t in out["output_ids"] if t not in engine.eos_token_ids]
    want = [t for t in ref.tokens if t not in engine.eos_token_ids]
    exactness(name, {"identical": got == want, "compared_tokens": len(want)})
    assert got == want
    return ref.text
