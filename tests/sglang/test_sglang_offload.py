"""``full_kv: "host"`` on SGLang's own objects (CPU): requests' rows offloaded to the host tier,
reloaded into the reload arena for their verifications, and freed by SGLang's own
``release_kv_cache`` through the vericache radix cache without a slot lost or freed twice.

What cannot run here is the model: the verify pass is replaced by a reader of what attention would
read (the request's ``req_to_token`` row through the pool's waiting accessors). The worker that
calls ``FullKVOffload`` with SGLang's forward passes is unverified (GPU).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("sglang.srt.mem_cache.l2_transfer", reason="sglang is not installed")

from offload_setup import (
    SIZE,
    Setup,
    finish,
    grouped_reading,
    host_offload,
    plan_and_draft,
    published_server_args,  # noqa: F401  (autouse: SGLang's published server args)
    verified_exactly,
)
from sglang.srt.mem_cache.base_prefix_cache import EvictParams
from sglang.srt.mem_cache.common import release_kv_cache

from vericache_sglang.sglang.full_kv.offload_rows import (
    PAD_SLOT,
    RequestOffload,
    SlotArena,
    offload_for,
    register_offload,
)


def test_a_request_decodes_with_its_rows_on_the_host_and_sglang_frees_them_once():
    s = Setup()
    host, released = host_offload(s, reload_room=0.25)  # 128 arena slots
    total = s.alloc.available_size()
    req = s.request("a", list(range(1, 61)))
    assert host.offload(req, 60) == 60
    assert offload_for(s.alloc) is host.ledger and req.skip_radix_cache_insert
    row = s.rows.req_to_token[req.kv.req_pool_idx]
    assert bool((row[:60] == PAD_SLOT).all())  # the device holds none of it
    assert s.alloc.available_size() == total - host.arena_slots  # its 60 slots back, the arena taken
    for step in range(3):
        plan_and_draft(host, [req])
        assert "a" in host.reloads.inflight  # its reload started while drafting ran
        assert verified_exactly(host, s, req), f"step {step}: the verify pass did not read the exact full KV"
        assert bool((row[: req.kv.kv_committed_len] == PAD_SLOT).all())  # lent slots returned
        assert host.arena.available_size() == host.arena_slots
        s.extend(req, 3)  # the verify pass committed 3 tokens
        req.output_ids.extend([7, 7, 7])
        assert host.offload(req, req.kv.kv_committed_len) == 3
    # SGLang finishes it: its own release path, through the radix cache's free_kv_row/on_release
    s.extend(req, 2)  # two more slots the scheduler had allocated past the stop (overallocated)
    req.kv.kv_committed_len -= 2
    finish(req)
    release_kv_cache(req, s.cache, checkpoint=True)
    assert released == ["a"] and "a" not in host.ledger and host.arena is None
    assert s.alloc.available_size() == total  # every slot back once: offloaded, resident and arena
    assert host.tier.available_tokens() == host.tier.host_pool.size


def test_a_matched_prefix_stays_with_the_tree_and_only_the_requests_own_rows_move():
    s = Setup()
    host, _ = host_offload(s)
    total = s.alloc.available_size()
    prompt = list(range(100, 148))
    first, req = s.over_cached_prefix(prompt, 20)
    assert host.offload(req, 48) == 28  # only [20, 48): the prefix is the tree's
    plan_and_draft(host, [req])
    assert verified_exactly(host, s, req)
    finish(req)
    release_kv_cache(req, s.cache, checkpoint=True)
    s.rows.free(first)  # the tree owns its 20 slots
    s.cache.evict(EvictParams(num_tokens=SIZE))
    assert s.alloc.available_size() == total


def test_groups_verify_one_after_another_in_the_reload_room():
    """Six requests whose full KV together is three times the reload room: every verification
    in a step reads exact KV, and no group needs more than the room."""
    s = Setup()
    host, _ = host_offload(s, reload_room=0.25)  # 128 slots; each request holds 60
    total = s.alloc.available_size()
    reqs = [s.request(f"r{i}", list(range(1000 * i, 1000 * i + 60))) for i in range(6)]
    for req in reqs:
        host.offload(req, 60)
    for step in range(3):
        plan_and_draft(host, reqs)
        groups: list[list[int]] = []
        logits = host.verify(reqs, grouped_reading(s, reqs, groups), width=5)
        assert sorted(i for g in groups for i in g) == list(range(6)) and len(groups) >= 3
        assert all(sum(host.tier.num_tokens(reqs[i].rid) for i in g) <= host.arena_slots for g in groups)
        # the logits come back in batch order whatever the groups were
        assert torch.equal(logits.view(6, 5, 2), torch.arange(6.0)[:, None, None].expand(6, 5, 2))
        for i, req in enumerate(reqs):  # each commits 1 to 5 tokens, which go to the host too
            s.extend(req, 1 + (i + step) % 5)
            host.offload(req, req.kv.kv_committed_len)
    for req in reqs:
        release_kv_cache(req, s.cache, checkpoint=False)  # as a retraction releases them
    assert host.arena is None and s.alloc.available_size() == total
    assert host.tier.available_tokens() == host.tier.host_pool.size


def test_a_request_larger_than_the_reload_room_keeps_its_tail_on_the_device():
    s = Setup()
    host, _ = host_offload(s, reload_room=0.1)  # 51 arena slots
    req = s.request("big", list(range(1, 81)))
    assert host.offload(req, 80) == host.arena_slots
    row = s.rows.req_to_token[req.kv.req_pool_idx]
    assert bool((row[: host.arena_slots] == PAD_SLOT).all()) and bool((row[host.arena_slots : 80] != PAD_SLOT).all())
    plan_and_draft(host, [req])
    assert verified_exactly(host, s, req)


def test_the_ledger_refuses_what_would_lose_kv():
    s = Setup()
    from vericache_sglang.sglang.full_kv.host_tier import HostFullKV

    ledger = RequestOffload(HostFullKV(s.pool, 256, io_backend="torch"), s.rows, s.alloc)
    register_offload(s.alloc, ledger)
    req = s.request("a", list(range(1, 21)))
    idx = req.kv.req_pool_idx
    ledger.offload_through("a", idx, 0, 20)
    with pytest.raises(ValueError, match="unallocated"):
        ledger.offload_through("a", idx, 0, 25)  # positions 20..24 were never allocated
    with pytest.raises(ValueError, match="moved"):
        ledger.offload_through("a", idx, 4, 20)
    arena = SlotArena(s.alloc, 30)
    short = arena.alloc(19)
    with pytest.raises(ValueError, match="19 slots for 20"):
        ledger.lend("a", short)
    arena.free(short)
    ledger.lend("a", arena.alloc(20))
    with pytest.raises(RuntimeError, match="already holds"):
        ledger.lend("a", torch.arange(20))
    with pytest.raises(RuntimeError, match="lent"):
        ledger.offload_through("a", idx, 0, 20)
    with pytest.raises(RuntimeError, match="still lent"):
        arena.close()
    arena.free(ledger.unlend("a"))
    with pytest.raises(ValueError, match="reload arena asks"):
        SlotArena(s.alloc, SIZE)
    assert ledger.resident_ranges(idx, [(0, 30)]) == [(20, 30)]
    assert ledger.resident_ranges(idx + 1, [(0, 30)]) == [(0, 30)]
