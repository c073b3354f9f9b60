"""Where the full KV lives, end to end in real SGLang servers: ``full_kv`` "store" (our gRPC store,
Redis) and "host" (SGLang's host pool, reloaded per layer for each verification), with both
SGLang-path compressors and, on the host, with the drafting modifiers; every answer is stock
SGLang's. The default set runs SnapKV on the host, the plain draft loop (the store mode, which is
the device mode plus the store's writes, is the session's shared server:
``tests/sglang/test_sglang_e2e.py``); the whole matrix, the modifiers on the host and the host
mode's memory saving are in the heavy set."""

from __future__ import annotations

import pytest
from conftest import SGLANG_TEST_FLAGS
from sglang_e2e import COPY, MODIFIERS, PERSON_FORMAT, compare_answers, prompt, same_as_stock

from vericache_sglang.bench.sglang_server import Ask, SGLangServer, accepted_length, run_load

pytestmark = [pytest.mark.real_model, pytest.mark.sglang]

SNAPKV = "snapkv:ratio=0.125"
STREAMING = "streamingllm:sink=4,window=256"


def _config(compressor: str, full_kv: str, store: str | None = None) -> dict:
    cfg = {"compressor": compressor, "horizon": 8, "full_kv": full_kv}
    if store:
        cfg["store"] = store
    if full_kv == "host":
        cfg.update(reload_room=0.2, host_pool_ratio=1.0)
    return cfg


def _questions() -> list[Ask]:
    return [
        Ask(prompt("prose"), "completion", max_tokens=32, params={"logprobs": 1}),
        Ask(prompt("code"), "chat", stream=True, max_tokens=24),
    ]


def _check_identical(stock, server, exactness, name):
    same_as_stock(stock, server, _questions(), exactness, name)
    assert accepted_length(server.metrics()) > 1.5


def _mode_evidence(server, full_kv):
    m = server.metrics()
    if full_kv == "device":
        assert m["vericache_full_kv_written_bytes_total"] == 0
    else:  # written to the store, or offloaded to the host pool
        assert m["vericache_full_kv_written_bytes_total"] > 0
    if full_kv == "host":  # every verification reloaded its request's KV
        assert m["vericache_full_kv_fetched_bytes_total"] > 0
    assert m["vericache_store_errors_total"] == 0


@pytest.mark.parametrize(
    ("compressor", "full_kv", "store"),
    [
        pytest.param(STREAMING, "store", "grpc", id="streamingllm-store-grpc", marks=pytest.mark.slow),
        pytest.param(SNAPKV, "host", None, id="snapkv-host"),
        pytest.param(STREAMING, "device", None, id="streamingllm-device", marks=pytest.mark.slow),
        pytest.param(SNAPKV, "store", "grpc", id="snapkv-store-grpc", marks=pytest.mark.slow),
        pytest.param(SNAPKV, "store", "redis", id="snapkv-store-redis", marks=pytest.mark.slow),
        pytest.param(STREAMING, "store", "redis", id="streamingllm-store-redis", marks=pytest.mark.slow),
        pytest.param(STREAMING, "host", None, id="streamingllm-host", marks=pytest.mark.slow),
    ],
)
def test_each_full_kv_place_answers_as_stock(request, stock_server, sglang_logs, exactness, compressor, full_kv, store):
    url = request.getfixturevalue({"grpc": "store_url", "redis": "redis_url"}[store]) if store else None
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
def test_host_mode_holds_fewer_tokens_on_the_device_than_stock(stock_server, sglang_logs, exactness):
    """Six 2,000-token requests at once: stock SGLang holds all their KV on the device; with
    ``full_kv: "host"`` the device holds the reload room, what is being prefilled and the
    compressed copies are elsewhere (the worker's own pool)."""
    load = [
        Ask(prompt(name, 2000), kind, max_tokens=24)
        for name in ("prose", "code", "tools")
        for kind in ("completion", "chat")
    ]
    server = SGLangServer(sglang_logs, "snapkv-host-peak", vericache=_config(SNAPKV, "host"))
    try:
        stock, host = run_load(stock_server, load), run_load(server, load)
        stock_peak, expected, host_peak, got = stock.peak_tokens, stock.answers, host.peak_tokens, host.answers
        for q, ref, out in zip(load, expected, got, strict=True):
            cmp = compare_answers(ref, out)
            exactness(f"sglang host peak load {q.label()}", cmp, stock_peak=stock_peak, host_peak=host_peak)
            assert cmp["identical"], (q.label(), ref.text, out.text)
    finally:
        server.stop()
    assert stock_peak >= 6 * 2000
    assert host_peak < stock_peak, (host_peak, stock_peak)
