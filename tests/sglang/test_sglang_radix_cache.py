"""The vericache radix-cache backend on SGLang's own radix cache, KV pool and allocator (CPU).

Real KV: SmolLM2's prefill of real prompts is written into SGLang's ``MHATokenToKVPool``; the
compressed copies are made from those pool rows by real compressors.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("sglang.srt.mem_cache.radix_cache", reason="sglang is not installed")

from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import EvictParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.mem_cache.radix_cache import RadixKey

from vericache_sglang.core.compress import parse_spec
from vericache_sglang.core.kv import FullKV
from vericache_sglang.sglang.draft.radix_cache import VeriCacheRadixCache
from vericache_sglang.sglang.pool_kv import compress_from_pool, read_full_kv, write_full_kv

pytestmark = pytest.mark.real_model

PREFIX = 300  # tokens the two prompts share


@pytest.fixture(scope="module")
def setup(real_engine):
    from conftest import PROMPTS

    text = (PROMPTS / "prose.txt").read_text()
    a = real_engine.encode(text[:2400], chat=False)
    b = a[:PREFIX] + real_engine.encode(" An unrelated ending about tide pools and their crabs.", chat=False)
    pre_a, pre_b = real_engine.prefill(a, reuse_prefix=False), real_engine.prefill(b, reuse_prefix=False)
    layout = real_engine.runner.layout
    pool = MHATokenToKVPool(
        size=4096,
        page_size=1,
        dtype=layout.dtype,
        head_num=layout.num_kv_heads,
        head_dim=layout.head_dim,
        layer_num=layout.num_layers,
        device="cpu",
        enable_memory_saver=False,
    )
    alloc = TokenToKVPoolAllocator(size=4096, dtype=layout.dtype, device="cpu", kvcache=pool, need_sort=False)
    return {"a": a, "b": b, "pre_a": pre_a, "pre_b": pre_b, "layout": layout, "pool": pool, "alloc": alloc}


def _fresh_cache(alloc) -> VeriCacheRadixCache:
    return VeriCacheRadixCache(
        CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=alloc, page_size=1)
    )


def _same_copy(x, y) -> bool:
    return all(
        torch.equal(lx.read()[0], ly.read()[0]) and torch.equal(lx.read()[1], ly.read()[1])
        for lx, ly in zip(x.layers, y.layers, strict=True)
    )


@pytest.mark.parametrize("spec", ["snapkv:ratio=0.25", "streamingllm:sink=4,window=128"])
def test_copies_inserted_matched_and_evicted_with_the_tree(setup, spec):
    pool, alloc, layout = setup["pool"], setup["alloc"], setup["layout"]
    comp = parse_spec(spec)
    cache = _fresh_cache(alloc)
    free0 = alloc.available_size()

    slots_a = alloc.alloc(len(setup["a"]))
    write_full_kv(pool, slots_a, setup["pre_a"].kv)
    # the pool holds the prefill's KV bit for bit, and a copy made from the pool is the copy the
    # engine makes from its own KV
    from_pool = read_full_kv(pool, slots_a, layout).layers
    assert all(
        torch.equal(x, y)
        for lx, ly in zip(from_pool, setup["pre_a"].kv.layers, strict=True)
        for x, y in zip(lx, ly, strict=True)
    )
    copy_a = compress_from_pool(pool, slots_a, layout, comp, setup["pre_a"].obs)
    assert _same_copy(copy_a, comp.compress(setup["pre_a"].kv, setup["pre_a"].obs))
    assert copy_a.nbytes < setup["pre_a"].kv.nbytes / 2
    cache.insert_with_copy(RadixKey(setup["a"]), slots_a, copy_a)

    # the whole prompt matches and comes with its copy
    m, c = cache.match_with_copy(RadixKey(setup["a"] + [7, 8, 9]))
    assert m.device_prefix_len == len(setup["a"]) and c is not None and c.num_tokens == len(setup["a"])
    assert c.kv is copy_a

    # a prompt sharing only PREFIX tokens matches those, splits the node, and gets no copy: the
    # only copy covers tokens it does not share
    m, c = cache.match_with_copy(RadixKey(setup["b"]))
    assert m.device_prefix_len == PREFIX and c is None

    # B's own tail goes in with B's copy (its prefix slots are A's, shared through the tree)
    b = setup["b"]
    slots_b_tail = alloc.alloc(len(b) - PREFIX)
    write_full_kv(pool, slots_b_tail, setup["pre_b"].kv.slice(PREFIX, len(b)))
    slots_b = torch.cat([slots_a[:PREFIX], slots_b_tail])
    copy_b = compress_from_pool(pool, slots_b, layout, comp, setup["pre_b"].obs)
    # the pool's B row is A's prefix KV (shared, not recomputed) then B's tail
    kv_b = FullKV(
        layout,
        [
            (torch.cat([ka[:, :PREFIX], kb[:, PREFIX:]], 1), torch.cat([va[:, :PREFIX], vb[:, PREFIX:]], 1))
            for (ka, va), (kb, vb) in zip(setup["pre_a"].kv.layers, setup["pre_b"].kv.layers, strict=True)
        ],
    )
    assert _same_copy(copy_b, comp.compress(kv_b, setup["pre_b"].obs))
    cache.insert_with_copy(RadixKey(b), slots_b, copy_b)
    assert cache.copy_count() == 2
    assert cache.compressed_bytes == copy_a.nbytes + copy_b.nbytes
    assert cache.match_with_copy(RadixKey(setup["a"]))[1].kv is copy_a  # the split left A's copy whole

    # touch B so A's tail is the least recently used leaf, then evict that much
    cache.match_with_copy(RadixKey(b))
    freed = cache.evict(EvictParams(num_tokens=len(setup["a"]) - PREFIX)).num_tokens_evicted
    assert freed == len(setup["a"]) - PREFIX
    assert cache.copy_count() == 1 and cache.copies_evicted == 1
    assert cache.compressed_bytes == copy_b.nbytes
    m, c = cache.match_with_copy(RadixKey(setup["a"]))
    assert m.device_prefix_len == PREFIX and c is None  # A's prefix is gone and so is its copy
    assert cache.match_with_copy(RadixKey(b))[1].kv is copy_b

    # a locked prefix keeps its tree nodes and its copy under eviction pressure
    node_b = cache.match_with_copy(RadixKey(b))[0].last_device_node
    cache.inc_lock_ref(node_b)
    cache.evict(EvictParams(num_tokens=10_000))
    assert cache.copy_count() == 1
    cache.dec_lock_ref(node_b)
    cache.evict(EvictParams(num_tokens=10_000))
    assert cache.copy_count() == 0 and cache.compressed_bytes == 0
    assert cache.match_with_copy(RadixKey(b))[0].device_prefix_len == 0
    assert alloc.available_size() == free0  # every slot went back to SGLang's allocator


def test_copy_must_end_at_its_node(setup):
    cache = _fresh_cache(setup["alloc"])
    comp = parse_spec("streamingllm:sink=4,window=64")
    slots = setup["alloc"].alloc(len(setup["a"]))
    write_full_kv(setup["pool"], slots, setup["pre_a"].kv)
    copy = compress_from_pool(setup["pool"], slots, setup["layout"], comp)
    result = cache.insert_with_copy(RadixKey(setup["a"]), slots, copy)
    from vericache_sglang.sglang.draft.radix_cache import CompressedPrefix

    with pytest.raises(ValueError, match="node ending its prefix"):
        cache.attach_copy(result.last_device_node, CompressedPrefix(PREFIX, copy))
    cache.evict(EvictParams(num_tokens=10_000))
    assert cache.copy_count() == 0
