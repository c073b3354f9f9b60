"""The host tier and staggered reloads on SGLang's own pools, host pool, transfer engine and layer
counter (CPU, the ``torch`` io backend; SGLang's CUDA copy kernels are not run here).

Tiny pools with random KV check the bookkeeping and the bad inputs; SmolLM2's real prefill KV goes
through the tier and back and decodes identically; a run of the core's staggered scheduler over
the tier checks that reloads never hold more device slots than the budget and that every
verification reads exactly the KV that was offloaded.
"""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("sglang.srt.mem_cache.l2_transfer", reason="sglang is not installed")

from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

from vericache_sglang.core.schedule import StaggeredScheduler
from vericache_sglang.engine.engine import compare
from vericache_sglang.engine.generation import Prefill
from vericache_sglang.sglang.full_kv.host_tier import HostFullKV, HostTierFull
from vericache_sglang.sglang.full_kv.reloads import ReloadRoomExhausted, StaggeredReloads
from vericache_sglang.sglang.pool_kv import pool_layout, read_full_kv, write_full_kv

LAYERS, HEADS, DIM = 4, 3, 16


def _pool(
    size: int = 512, dtype: torch.dtype = torch.float32, layers: int = LAYERS, heads: int = HEADS, dim: int = DIM
) -> tuple[MHATokenToKVPool, TokenToKVPoolAllocator]:
    pool = MHATokenToKVPool(
        size=size,
        page_size=1,
        dtype=dtype,
        head_num=heads,
        head_dim=dim,
        layer_num=layers,
        device="cpu",
        enable_memory_saver=False,
    )
    return pool, TokenToKVPoolAllocator(size=size, dtype=dtype, device="cpu", kvcache=pool, need_sort=False)


def _fill(pool: MHATokenToKVPool, slots: torch.Tensor, gen: torch.Generator) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Random KV at ``slots``; returns what was written, per layer ``[n, heads, dim]``."""
    written = []
    for layer in range(pool.layer_num):
        k = torch.randn(slots.numel(), pool.head_num, pool.head_dim, generator=gen)
        v = torch.randn(slots.numel(), pool.head_num, pool.head_dim, generator=gen)
        pool.k_buffer[layer][slots] = k
        pool.v_buffer[layer][slots] = v
        written.append((k, v))
    return written


def _read_waiting(pool: MHATokenToKVPool, slots: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """What attention would read: through the pool's accessors that wait on the layer counter."""
    return [
        (pool.get_key_buffer(layer)[slots].clone(), pool.get_value_buffer(layer)[slots].clone())
        for layer in range(pool.layer_num)
    ]


def _equal(a, b) -> bool:
    return all(torch.equal(ka, kb) and torch.equal(va, vb) for (ka, va), (kb, vb) in zip(a, b, strict=True))


def test_offload_free_and_reload_into_other_slots_is_bit_exact():
    pool, alloc = _pool()
    tier = HostFullKV(pool, capacity_tokens=256, io_backend="torch")
    gen = torch.Generator().manual_seed(0)
    prompt = alloc.alloc(40)
    expected = _fill(pool, prompt, gen)
    tier.wait_offloaded(tier.offload("a", prompt))
    # committed tokens are appended after each verification
    commit = alloc.alloc(7)
    more = _fill(pool, commit, gen)
    tier.wait_offloaded(tier.offload("a", commit))
    expected = [(torch.cat([k, k2]), torch.cat([v, v2])) for (k, v), (k2, v2) in zip(expected, more, strict=True)]
    free_before = alloc.available_size()
    alloc.free(torch.cat([prompt, commit]))
    assert alloc.available_size() == free_before + 47  # the device holds none of it now
    assert tier.num_tokens("a") == 47 and tier.nbytes("a") == 47 * LAYERS * 2 * HEADS * DIM * 4

    _fill(pool, alloc.alloc(100), gen)  # the freed slots are reused and overwritten
    target = alloc.alloc(47)
    producer = tier.reload([("a", target)])
    tier.consume(producer)
    assert tier.counter.consumer_index == producer  # readers now wait per layer on this reload
    assert _equal(_read_waiting(pool, target), expected)
    tier.done()
    assert tier.counter.consumer_index == -1
    host_free = tier.available_tokens()
    tier.release("a")
    assert tier.available_tokens() == host_free + 47 and "a" not in tier


def test_reload_of_several_requests_in_one_submission():
    pool, alloc = _pool()
    tier = HostFullKV(pool, capacity_tokens=256, io_backend="torch")
    gen = torch.Generator().manual_seed(1)
    expected = {}
    for rid, n in (("a", 30), ("b", 11), ("c", 52)):
        slots = alloc.alloc(n)
        expected[rid] = _fill(pool, slots, gen)
        tier.wait_offloaded(tier.offload(rid, slots))
        alloc.free(slots)
    targets = [(rid, alloc.alloc(tier.num_tokens(rid))) for rid in ("c", "a")]
    tier.consume(tier.reload(targets))
    for rid, slots in targets:
        assert _equal(_read_waiting(pool, slots), expected[rid])
    tier.done()


def test_under_hicache_the_tier_leaves_the_pools_layer_counter_to_it():
    """With HiCache on, its controller registers its own counter on the pool after the worker's tier
    is built: the tier (``per_layer=False``) registers none, and a verify pass waits for its whole
    load; what it reads is exact, and HiCache's counter is the one the pool waits on."""
    from sglang.srt.managers.cache_controller import LayerDoneCounter

    pool, alloc = _pool()
    tier = HostFullKV(pool, capacity_tokens=64, io_backend="torch", per_layer=False)
    assert pool.layer_transfer_counter is None
    hicache = LayerDoneCounter(pool.layer_num)
    pool.register_layer_transfer_counter(hicache)  # as HiCacheController does
    slots = alloc.alloc(20)
    expected = _fill(pool, slots, torch.Generator().manual_seed(2))
    tier.wait_offloaded(tier.offload("a", slots))
    alloc.free(slots)
    target = alloc.alloc(20)
    tier.consume(tier.reload([("a", target)]))
    assert tier.counter.consumer_index == -1 and pool.layer_transfer_counter is hicache
    assert _equal(_read_waiting(pool, target), expected)
    tier.done()


def test_bad_input_is_refused_and_loses_nothing():
    pool, alloc = _pool()
    tier = HostFullKV(pool, capacity_tokens=32, io_backend="torch")
    gen = torch.Generator().manual_seed(2)
    slots = alloc.alloc(20)
    _fill(pool, slots, gen)
    tier.wait_offloaded(tier.offload("a", slots))
    with pytest.raises(HostTierFull, match="12 free of 32"):
        tier.offload("b", alloc.alloc(20))
    assert "b" not in tier and tier.available_tokens() == 12 and tier.num_tokens("a") == 20
    with pytest.raises(ValueError, match="19 device slots for 20 held tokens"):
        tier.reload([("a", alloc.alloc(19))])
    with pytest.raises(KeyError, match="no full KV"):
        tier.reload([("nope", alloc.alloc(3))])
    with pytest.raises(ValueError, match="nothing to offload"):
        tier.offload("a", torch.empty(0, dtype=torch.int64))
    with pytest.raises(ValueError, match="nothing to reload"):
        tier.reload([])
    with pytest.raises(ValueError, match="another layer counter"):
        HostFullKV(pool, capacity_tokens=32)  # the pool already waits on this tier's counter
    with pytest.raises(ValueError, match="io backend"):
        HostFullKV(_pool()[0], capacity_tokens=32, io_backend="rdma")
    with pytest.raises(ValueError, match="capacity"):
        HostFullKV(_pool()[0], capacity_tokens=0)
    with pytest.raises(TypeError, match="MHA"):
        HostFullKV(object(), capacity_tokens=32)  # type: ignore[arg-type]


def test_staggered_reloads_stay_in_budget_and_every_verification_reads_exact_kv():
    """Ten requests of mixed lengths decode for 40 iterations: each verifies about every
    ``horizon + 1`` iterations, its full KV reloaded on the core scheduler's plan into slots that
    exist only from its reload's start to its verification, then appended with the tokens it
    committed. The allocator for reloads has exactly the scheduler's budget, so a plan that
    over-committed device memory would fail to allocate."""
    horizon, budget_tokens = 4, 300
    pool, alloc = _pool(size=budget_tokens)
    tier = HostFullKV(pool, capacity_tokens=4096, io_backend="torch")
    bytes_per_token = tier.bytes_per_token
    # link: 100 tokens' KV per iteration, so long requests span several iterations
    sched = StaggeredScheduler(
        window=3 * (horizon + 1),
        iteration_s=0.01,
        link_bytes_s=100 * bytes_per_token / 0.01,
        memory_capacity=budget_tokens * bytes_per_token,
    )
    reloads = StaggeredReloads(tier, sched, alloc)
    rng, gen = random.Random(3), torch.Generator().manual_seed(3)
    expected: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def append(rid: str, n: int) -> None:
        """Tokens a verify pass wrote (new KV in the pool) go to the host, their slots back."""
        slots = alloc.alloc(n)
        new = _fill(pool, slots, gen)
        tier.wait_offloaded(tier.offload(rid, slots))
        alloc.free(slots)
        old = expected.get(rid)
        expected[rid] = (
            new
            if old is None
            else [(torch.cat([k0, k]), torch.cat([v0, v])) for (k0, v0), (k, v) in zip(old, new, strict=True)]
        )

    rids = [f"r{i}" for i in range(10)]
    for rid in rids:
        append(rid, rng.randint(20, 140))
    verified = {rid: 0 for rid in rids}
    planned: set[str] = set()
    peak = 0
    for _ in range(40):
        for rid in rids:
            if rid not in planned:
                reloads.admit(rid, anchor_gap=horizon + 1)
                planned.add(rid)
        reloads.start_due()
        peak = max(peak, reloads.device_tokens())
        for reload in reloads.verifying():
            tier.consume(reload.producer)
            assert _equal(_read_waiting(pool, reload.slots), expected[reload.rid]), reload.rid
            tier.done()
            reloads.verified(reload.rid)
            planned.discard(reload.rid)
            verified[reload.rid] += 1
            append(reload.rid, rng.randint(1, horizon + 1))  # what it committed
        sched.check()
        assert reloads.device_tokens() <= budget_tokens
        reloads.end_iteration(0.01)
    assert min(verified.values()) >= 2, verified
    assert peak <= budget_tokens and peak > max(tier.num_tokens(r) for r in rids) // 2
    for rid in rids:
        reloads.cancel(rid)
    assert alloc.available_size() == budget_tokens  # every reload slot came back


def test_a_reload_larger_than_the_allocator_fails_cleanly():
    pool, alloc = _pool(size=64)
    tier = HostFullKV(pool, capacity_tokens=256, io_backend="torch")
    slots = alloc.alloc(60)
    _fill(pool, slots, torch.Generator().manual_seed(4))
    tier.wait_offloaded(tier.offload("a", slots))
    alloc.alloc(10)  # the allocator now has less than the scheduler was told
    sched = StaggeredScheduler(window=6, iteration_s=0.01, link_bytes_s=1e12, memory_capacity=10**9)
    reloads = StaggeredReloads(tier, sched, alloc)
    reloads.admit("a", anchor_gap=1)
    while not reloads.inflight:
        try:
            reloads.start_due()
        except ReloadRoomExhausted as e:
            assert "60 device slots" in str(e)
            break
        reloads.end_iteration(0.01)
    else:
        pytest.fail("the reload should not have found room")
    assert not reloads.inflight and tier.num_tokens("a") == 60  # nothing lost


@pytest.mark.real_model
def test_smollm2_decodes_identically_from_kv_that_went_through_the_host_tier(real_engine, exactness):
    from conftest import PROMPTS

    tokens = real_engine.encode((PROMPTS / "prose.txt").read_text()[:3000])
    pre = real_engine.prefill(tokens, reuse_prefix=False)
    layout = real_engine.runner.layout
    pool, alloc = _pool(
        size=2 * len(tokens),
        dtype=layout.dtype,
        layers=layout.num_layers,
        heads=layout.num_kv_heads,
        dim=layout.head_dim,
    )
    assert pool_layout(pool, layout.model_id).digest() == layout.digest()
    tier = HostFullKV(pool, capacity_tokens=len(tokens), io_backend="torch")
    slots = alloc.alloc(len(tokens))
    write_full_kv(pool, slots, pre.kv)
    tier.wait_offloaded(tier.offload("prose", slots))
    _fill(pool, slots, torch.Generator().manual_seed(5))  # the device copy is gone (overwritten)
    alloc.free(slots)
    alloc.alloc(len(tokens) // 3)  # another request takes slots, so the reload lands elsewhere
    target = alloc.alloc(len(tokens))
    tier.consume(tier.reload([("prose", target)]))
    reloaded = read_full_kv(pool, target, layout)
    tier.done()
    assert all(
        torch.equal(a, b)
        for (ka, va), (kb, vb) in zip(pre.kv.layers, reloaded.layers, strict=True)
        for a, b in ((ka, kb), (va, vb))
    )
    cfg = real_engine.config(max_new_tokens=32, keep_logits=True)
    reference = real_engine.generate(pre, "full", cfg=cfg)
    through = Prefill(pre.tokens, reloaded, pre.logits, pre.obs, pre.seconds)
    for method in ("full", "vericache"):
        cmp = compare(reference, real_engine.generate(through, method, compressor="snapkv:ratio=0.25", cfg=cfg))
        exactness(f"sglang host tier round trip, then {method} decoding", cmp)
        assert cmp["identical"], cmp
