"""Where the full KV lives, end to end in real SGLang servers: ``full_kv`` "store" (only in our gRPC
store or Redis, fetched for each verification while drafting runs), "host" (SGLang's host pool,
reloaded per layer for each verification) and "device", with both SGLang-path compressors and, on
the host, with the drafting modifiers; every answer is stock SGLang's. The default set runs
SnapKV with the full KV in our gRPC store, the plain draft loop (the device mode with the drafting
modifiers is the session's shared server: ``tests/sglang/test_sglang_e2e.py``; the host mode's
pieces run on SGLang's objects in ``test_sglang_offload.py`` and ``test_sglang_host_tier.py``); the
whole matrix (Redis and LMCache stores, the host), the modifiers on the host and both offloading
modes' memory saving are in the heavy set."""

from __future__ import annotations

import pytest
from conftest import SGLANG_TEST_FLAGS
from sglang_e2e import (
    COPY,
    MODIFIERS,
    PERSON_FORMAT,
    bytes_are_the_requests_full_kv,
    compare_answers,
    prompt,
    same_as_stock,
    store_mode_config,
)
from transformers import AutoConfig

from vericache_sglang.bench.sglang_server import Ask, SGLangServer, accepted_length, run_load, tokenizer
from vericache_sglang.engine.model import smollm2_dir

pytestmark = [pytest.mark.real_model, pytest.mark.sglang]

SNAPKV = "snapkv:ratio=0.125"
STREAMING = "streamingllm:sink=4,window=256"


def _config(compressor: str, full_kv: str, store: str | None = None) -> dict:
    cfg = {"compressor": compressor, "horizon": 8, "full_kv": full_kv}
    if store:
        cfg["store"] = store
    if full_kv == "host":
        cfg.update(reload_room=0.2, host_pool_ratio=1.0)
    if full_kv == "store":
        cfg.update(reload_room=0.2)
    return cfg


def _questions() -> list[Ask]:
    return [
        Ask(prompt("prose"), "completion", max_tokens=24, params={"logprobs": 1}),
        Ask(prompt("code"), "chat", stream=True, max_tokens=16),
    ]


def _check_identical(stock, server, exactness, name):
    same_as_stock(stock, server, _questions(), exactness, name)
    assert accepted_length(server.metrics()) > 1.5


def _mode_evidence(server, full_kv):
    m = server.metrics()
    if full_kv == "device":
        assert m["vericache_full_kv_written_bytes_total"] == 0
    else:  # offloaded to the store or the host pool, and fetched back for every verification
        assert m["vericache_full_kv_written_bytes_total"] > 0
        assert m["vericache_full_kv_fetched_bytes_total"] > 0
        if full_kv == "store":  # the fetch thread's time, of which verify passes waited for a part
            assert m["vericache_full_kv_fetch_seconds_total"] > 0
            assert m["vericache_link_wait_seconds_total"] <= m["vericache_full_kv_fetch_seconds_total"]
        assert m["vericache_verify_passes_rerun_total"] == 0
    assert m["vericache_store_errors_total"] == 0
    assert m["vericache_full_kv_recomputes_total"] == 0


def test_the_full_kv_in_the_store_answers_as_stock_and_serves_a_stored_prefix(
    store_mode_launch, stock_server, exactness, store_url
):
    """The default set's store-mode server (SnapKV, our gRPC store): answers are stock's, every
    request's full KV went to the store and came back for its verifications; a prompt asked again
    finds its prefix in the store (the first request's prompt never entered the tree), loads it
    instead of prefilling it, and answers as stock does. What ``/metrics`` counts as written is that
    request's own full KV, once; as fetched, its whole context (the stored prefix left the device
    with it) once per verification."""
    # first in this module: its server is stopped before the others start (the host pool asks for
    # 10 GiB of free memory beside itself)
    server = store_mode_launch
    server.wait_healthy()
    try:
        _check_identical(stock_server, server, exactness, "snapkv-store-grpc")
        _mode_evidence(server, "store")
        again = [Ask(prompt("prose"), "completion", max_tokens=16)]
        before = server.metrics()
        _, (got,) = same_as_stock(stock_server, server, again, exactness, "snapkv-store-grpc prefix from the store")
        assert got.cached_tokens >= 896, got.cached_tokens  # whole chunks but the last 64 tokens
        m = server.metrics()
        assert m["vericache_store_prefix_hits_total"] >= 1 and m["vericache_store_prefix_tokens_total"] >= 896
        bytes_are_the_requests_full_kv(before, m, got, horizon=store_mode_config("")["horizon"])
        # a stored prefix whose records went bad after they were written (layer 15 of 30): promised to
        # the tree, failed mid-load, recomputed into its slots and the prefill run again: stock's tokens
        tools = [Ask(prompt("tools"), "completion", max_tokens=8)]
        same_as_stock(stock_server, server, tools, exactness, "snapkv-store-grpc tools")
        _garble_layer(store_url, tools[0].prompt, layer=15)
        again = [Ask(prompt("tools"), "completion", max_tokens=12)]
        before = server.metrics()
        _, (got,) = same_as_stock(
            stock_server, server, again, exactness, "snapkv-store-grpc prefix that failed to load"
        )
        grown = {k: v - before.get(k, 0.0) for k, v in server.metrics().items()}
        assert grown["vericache_store_prefix_fallbacks_total"] == 1 and grown["vericache_store_prefix_hits_total"] == 0
        assert got.cached_tokens >= 896, got.cached_tokens  # promised to the tree, computed there instead
        server.wait_healthy()
    finally:
        server.stop()


def _garble_layer(store_url: str, text: str, layer: int) -> None:
    """Overwrite one layer of every stored chunk of ``text``'s prompt with bytes that are no chunk."""
    import torch

    from remote_store import open_store
    from vericache_sglang.core.kv import KVLayout
    from vericache_sglang.full_kv.store import FullKVStore

    config = AutoConfig.from_pretrained(smollm2_dir())
    layout = KVLayout(
        str(smollm2_dir()), config.num_hidden_layers, config.num_key_value_heads, config.head_dim, torch.float32
    )
    store = FullKVStore(open_store(store_url), layout, namespace="sglang")
    tokens = tokenizer()(text)["input_ids"]
    keys = [store.key(ref, layer) for ref in store.refs(tokens, len(tokens))]
    assert store.backend.exists_many(keys[:-1]) == [True] * (len(keys) - 1), "the prompt's chunks are not stored"
    store.backend.put_many([(key, b"not a chunk") for key in keys])


@pytest.mark.parametrize(
    ("compressor", "full_kv", "store"),
    [
        pytest.param(STREAMING, "store", "grpc", id="streamingllm-store-grpc", marks=pytest.mark.slow),
        pytest.param(SNAPKV, "host", None, id="snapkv-host", marks=pytest.mark.slow),
        pytest.param(STREAMING, "device", None, id="streamingllm-device", marks=pytest.mark.slow),
        pytest.param(SNAPKV, "store", "redis", id="snapkv-store-redis", marks=pytest.mark.slow),
        pytest.param(SNAPKV, "store", "lmcache", id="snapkv-store-lmcache", marks=pytest.mark.slow),
        # the sharded store: Redis Cluster (three primaries) through redis-py's cluster client
        pytest.param(SNAPKV, "store", "redis-cluster", id="snapkv-store-redis-cluster", marks=pytest.mark.slow),
        pytest.param(STREAMING, "store", "redis", id="streamingllm-store-redis", marks=pytest.mark.slow),
        pytest.param(STREAMING, "host", None, id="streamingllm-host", marks=pytest.mark.slow),
    ],
)
def test_each_full_kv_place_answers_as_stock(request, stock_server, sglang_logs, exactness, compressor, full_kv, store):
    fixture = {
        "grpc": "store_url",
        "redis": "redis_url",
        "redis-cluster": "redis_cluster_url",
        "lmcache": "lmcache_url",
    }.get(store)
    url = request.getfixturevalue(fixture) if fixture else None
    name = f"{compressor.split(':')[0]}-{full_kv}{'-' + store if store else ''}"
    server = SGLangServer(sglang_logs, name, vericache=_config(compressor, full_kv, url))
    try:
        _check_identical(stock_server, server, exactness, name)
        _mode_evidence(server, full_kv)
    finally:
        server.stop()


@pytest.mark.slow
def test_modifiers_with_the_full_kv_on_the_host(stock_server, sglang_logs, exactness):
    """The drafting modifiers (``+refresh``, ``+lookup``) with ``full_kv: "host"``: each request's
    KV leaves the device after every verification and is reloaded for the next; refresh reads it
    while the reload is lent to the verify pass, lookup's passes are the reload plan's iterations.
    Answers are stock's (a JSON schema among them), and the reloads, refreshes and lookup drafts
    happened."""
    server = SGLangServer(
        sglang_logs,
        "vericache-modifiers-host",
        *SGLANG_TEST_FLAGS,
        vericache={**MODIFIERS, **_config(MODIFIERS["compressor"], "host")},
    )
    try:
        same_as_stock(
            stock_server,
            server,
            [
                Ask(prompt("prose"), "completion", params={"logprobs": 1}),
                Ask(COPY + prompt("code", 400), "chat", max_tokens=64),
                Ask(
                    "Describe Ada Lovelace as a JSON object with her name and age.",
                    "chat",
                    max_tokens=48,
                    params={"response_format": PERSON_FORMAT},
                ),
            ],
            exactness,
            "refresh+lookup host",
        )
        _mode_evidence(server, "host")  # written to the host pool, reloaded for verifications
        m = server.metrics()
        assert 0 < m["vericache_refreshes_total"] <= m["vericache_verify_passes_total"]
        assert m["vericache_lookup_drafted_tokens_total"] > 0
        assert accepted_length(m) > 1.5
    finally:
        server.stop()


@pytest.mark.slow
@pytest.mark.parametrize("full_kv", ["host", "store"])
def test_offloading_holds_at_most_half_the_device_tokens_of_stock(
    request, stock_server, sglang_logs, exactness, full_kv
):
    """Six 2,000-token requests at once: stock SGLang holds all their KV on the device; with
    ``full_kv`` "host" or "store" the device holds the reload room and what is being prefilled (the
    compressed copies are elsewhere: the worker's own pool). The prompts open with a line of their
    own: a prefix the session's other tests left in the shared store would be loaded into the radix
    tree, which keeps it on the device while requests use it, as stock's tree keeps a cached one."""
    load = [
        Ask(f"Peak-load request {i}.\n" + prompt(name, 2000), kind, max_tokens=24)
        for i, (name, kind) in enumerate(
            (name, kind) for name in ("prose", "code", "tools") for kind in ("completion", "chat")
        )
    ]
    store = request.getfixturevalue("store_url") if full_kv == "store" else None
    server = SGLangServer(sglang_logs, f"snapkv-{full_kv}-peak", vericache=_config(SNAPKV, full_kv, store))
    try:
        stock, ours = run_load(stock_server, load), run_load(server, load)
        stock_peak, expected, peak, got = stock.peak_tokens, stock.answers, ours.peak_tokens, ours.answers
        for q, ref, out in zip(load, expected, got, strict=True):
            cmp = compare_answers(ref, out)
            exactness(f"sglang {full_kv} peak load {q.label()}", cmp, stock_peak=stock_peak, peak=peak)
            assert cmp["identical"], (q.label(), ref.text, out.text)
        _mode_evidence(server, full_kv)
        assert server.metrics().get("vericache_store_prefix_hits_total", 0) == 0  # nothing loaded
    finally:
        server.stop()
    assert stock_peak >= 6 * 2000
    assert peak <= stock_peak / 2, (peak, stock_peak)
