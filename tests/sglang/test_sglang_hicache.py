"""HiCache and VeriCache in real SGLang servers on this CPU (HiCache through the platform layer's
answers, ``sglang/cpu/hicache.py``), both over our real gRPC store through our HiCache storage
backend (SGLang's ``dynamic`` route):

- ``--enable-vericache`` with ``--enable-hierarchical-cache``: SGLang's HiCache tree carries the
  compressed copies (``draft/hicache_tree.py``); server B answers over a document only server A
  has seen, its full KV prefetched from the store by HiCache, its compressed copy made on B, and
  both answers are stock SGLang's. A keeps running requests' own full KV in SGLang's host pool
  between verifications (``full_kv: "host"``); B keeps it only in the store (``full_kv: "store"``,
  the default): HiCache loads the document, VeriCache's store tier takes the request's whole
  context off the device (the matched document too) and fetches it for every verification;
  (heavy set) both servers with ``full_kv: "device"``;
- (heavy set) the same two-server run through stock SGLang with HiCache, the peer of
  ``vericache bench sglang-prefix``.

And the content-keyed copy table itself."""

from __future__ import annotations

import json
import uuid
from types import SimpleNamespace

import pytest
from conftest import SGLANG_TEST_FLAGS
from sglang_e2e import bytes_are_the_requests_full_kv, compare_answers, prompt, token_count

from vericache_sglang.bench.sglang_server import Ask, SGLangServer, accepted_length, ask

pytest.importorskip("sglang.srt.mem_cache.unified_radix_cache", reason="sglang is not installed")

from vericache_sglang.sglang.draft.hicache_tree import PrefixCopies
from vericache_sglang.sglang.draft.radix_cache import CompressedPrefix

HICACHE_ARGS = (
    "--enable-hierarchical-cache",
    "--hicache-storage-backend",
    "dynamic",
    "--hicache-write-policy",
    "write_through",
    "--hicache-storage-prefetch-policy",
    "wait_complete",
    # an explicit 1 GB host pool: SGLang's auto-sizing keeps 10 GiB of host memory free, which the
    # default set's other servers leave less than
    "--hicache-size",
    "1",
)
VERICACHE = {"compressor": "snapkv:ratio=0.125", "horizon": 8, "full_kv": "device"}


def _req(tokens, extra_key=None, salt=None):
    return SimpleNamespace(origin_input_ids=list(tokens), extra_key=extra_key, cache_salt=salt)


def _copy(n: int, nbytes: int = 10) -> CompressedPrefix:
    return CompressedPrefix(n, SimpleNamespace(nbytes=nbytes))


def test_prefix_copies_find_the_longest_kept_prefix_by_content():
    copies = PrefixCopies(max_copies=2)
    doc = list(range(1000))
    short, long_ = _copy(256), _copy(512)
    copies.keep(_req([*doc, 7, 7]), short)
    copies.keep(_req([*doc, 8]), long_)
    assert copies.longest(_req([*doc, 9, 9, 9]), cached=1000, grain=256) is long_  # another question, same doc
    assert copies.longest(_req(doc), cached=511, grain=256) is short  # only 511 tokens cached: not the 512 copy
    assert copies.longest(_req([5, *doc[1:]]), cached=1000, grain=256) is None  # first token differs
    assert copies.longest(_req(doc, extra_key="lora-a"), cached=1000, grain=256) is None  # another namespace
    assert copies.longest(_req(doc, salt="s"), cached=1000, grain=256) is None
    assert copies.nbytes == 20


def test_prefix_copies_drop_the_least_recently_used_beyond_their_cap():
    copies = PrefixCopies(max_copies=2)
    docs = [[i] * 300 for i in range(3)]
    for d in docs[:2]:
        copies.keep(_req(d), _copy(256))
    assert copies.longest(_req(docs[0]), 300, 256) is not None  # docs[0] used: docs[1] is the oldest
    copies.keep(_req(docs[2]), _copy(256))
    assert len(copies) == 2 and copies.evicted == 1 and copies.nbytes == 20
    assert copies.longest(_req(docs[1]), 300, 256) is None
    assert copies.longest(_req(docs[0]), 300, 256) is not None


def _two_servers(sglang_logs, store_url, name, vericache=None, vericache_b=None):
    """Servers A and B with HiCache over one fresh namespace of the store; B runs ``vericache_b``
    where given, else A's configuration."""
    extra = {
        "backend_name": "vericache",
        "module_path": "vericache_sglang.sglang.storage",
        "class_name": "VeriCacheHiCacheStorage",
        "interface_v1": 1,
        "store_url": store_url,
        "namespace": f"{name}-{uuid.uuid4().hex[:8]}",  # a fresh store namespace: B's hit is A's write
    }
    args = [*SGLANG_TEST_FLAGS, *HICACHE_ARGS, "--hicache-storage-backend-extra-config", json.dumps(extra)]
    if vericache is None:
        args.append("--disable-overlap-schedule")  # as the stock reference (and VeriCache) schedule
    # beside the suite's other servers on a small machine: SGLang's 10 GiB host reserve made 2
    env = {"VERICACHE_CPU_HICACHE_RESERVE_GIB": "2"}
    configs = {"a": vericache, "b": vericache_b or vericache}
    return [
        SGLangServer(sglang_logs, f"{name}-{side}", *args, vericache=configs[side], env=env, wait=False)
        for side in "ab"
    ]


def _document_through_a_then_b(stock_server, servers, exactness, name, a_offloads=False):
    """A answers over a document, then B another question over it; both must be stock's. Returns
    B's answer and B's server metrics before (after its warm-up requests) and after it."""
    document = prompt("prose", 1200)
    questions = [
        Ask("Summarise the document in two sentences.", max_tokens=24, params={"logprobs": True}, system=document),
        Ask("What is the most important detail?", max_tokens=24, params={"logprobs": True}, system=document),
    ]
    try:
        for s in servers:
            s.wait_healthy()
        a, b = servers
        first = ask(a, questions[0])
        if a_offloads:  # A's request left the device between verifications and came back for each
            m = a.metrics()
            assert m["vericache_full_kv_written_bytes_total"] > 0 and m["vericache_full_kv_fetched_bytes_total"] > 0
        before = b.metrics()
        second = ask(b, questions[1])
        metrics = b.metrics()
    finally:
        for s in servers:
            s.stop()
    assert first.cached_tokens == 0
    # B never saw the document: what SGLang reports cached came from A's pages in the store
    assert second.cached_tokens >= token_count(document) - 100, (second.cached_tokens, second.prompt_tokens)
    for side, q, got in (("a", questions[0], first), ("b", questions[1], second)):
        cmp = compare_answers(ask(stock_server, q), got)
        exactness(f"sglang {name} {side}", cmp, cached_tokens=got.cached_tokens)
        assert cmp["identical"], (side, got.text)
    return second, before, metrics


@pytest.mark.service
def test_vericache_with_hicache_reuses_a_document_another_server_cached(
    stock_server, sglang_logs, store_url, exactness
):
    host_mode = {**VERICACHE, "full_kv": "host", "reload_room": 0.2, "host_pool_ratio": 1.0}
    store_mode = {**VERICACHE, "full_kv": "store", "store": store_url, "reload_room": 0.2}
    servers = _two_servers(sglang_logs, store_url, "vericache-hicache", vericache=host_mode, vericache_b=store_mode)
    second, before, metrics = _document_through_a_then_b(
        stock_server, servers, exactness, "vericache-hicache", a_offloads=True
    )
    assert metrics["vericache_prefix_copies_made_total"] >= 1  # B compressed the document loaded by HiCache
    assert metrics["vericache_verify_passes_total"] >= 1
    assert accepted_length(metrics) > 1.5  # drafts over that copy were accepted
    # B's request held its context only in the store between verifications: the document HiCache
    # loaded left the device with it, and every verification fetched the whole context
    bytes_are_the_requests_full_kv(before, metrics, second, horizon=store_mode["horizon"], published=True)
    assert metrics["vericache_full_kv_recomputes_total"] == 0 and metrics["vericache_store_errors_total"] == 0


@pytest.mark.service
@pytest.mark.slow
def test_vericache_on_the_device_with_hicache_reuses_a_document_another_server_cached(
    stock_server, sglang_logs, store_url, exactness
):
    servers = _two_servers(sglang_logs, store_url, "vericache-hicache-device", vericache=VERICACHE)
    _, _, metrics = _document_through_a_then_b(stock_server, servers, exactness, "vericache-hicache-device")
    assert metrics["vericache_prefix_copies_made_total"] >= 1 and accepted_length(metrics) > 1.5
    assert metrics["vericache_full_kv_written_bytes_total"] == 0


@pytest.mark.service
@pytest.mark.slow
def test_stock_hicache_shares_a_document_through_the_store_as_stock_answers(
    stock_server, sglang_logs, store_url, exactness
):
    _document_through_a_then_b(stock_server, _two_servers(sglang_logs, store_url, "hicache"), exactness, "hicache")
