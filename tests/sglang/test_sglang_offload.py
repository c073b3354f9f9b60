"""``full_kv: "host"`` on SGLang's own objects (CPU): requests' rows offloaded to the host tier,
reloaded into the reload arena for their verifications, and freed by SGLang's own
``release_kv_cache`` through the vericache radix cache without a slot lost or freed twice.

What cannot run here is the model: the verify pass is replaced by a reader of what attention would
read (the request's ``req_to_token`` row through the pool's waiting accessors). The worker that
calls ``FullKVOffload`` with SGLang's forward passes is unverified (GPU).
"""

from __future__ import annotations

from array import array
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("sglang.srt.mem_cache.l2_transfer", reason="sglang is not installed")

from sglang.srt.managers.schedule_batch import FINISH_LENGTH, Req
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.common import release_kv_cache
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.plugins import load_plugins
from sglang.srt.sampling.sampling_params import SamplingParams

from vericache_sglang.sglang.config import VeriCacheConfig
from vericache_sglang.sglang.draft.radix_cache import VeriCacheRadixCache
from vericache_sglang.sglang.full_kv.offload import FullKVOffload
from vericache_sglang.sglang.full_kv.offload_rows import (
    PAD_SLOT,
    RequestOffload,
    SlotArena,
    offload_for,
    register_offload,
)

LAYERS, HEADS, DIM, SIZE = 3, 2, 8, 512


@pytest.fixture(scope="module", autouse=True)
def published_server_args():
    """SGLang's row release reads the server's published config (as in a scheduler process)."""
    from sglang.srt.runtime_context import get_context
    from sglang.srt.server_args import prepare_server_args

    from vericache_sglang.engine.model import smollm2_dir

    if not (smollm2_dir() / "config.json").exists():
        pytest.skip("SmolLM2 is not prepared (scripts/setup.sh); the server args need a model path")
    load_plugins()
    sa = prepare_server_args(
        [
            "--model-path",
            str(smollm2_dir()),
            "--device",
            "cpu",
            "--enable-vericache",
            "--vericache-config",
            '{"full_kv": "host"}',
        ]
    )
    sa.resolve_once()
    get_context().set_server_args(sa)


class Setup:
    """SGLang's pool, allocator, request rows and the vericache radix cache over them."""

    def __init__(self):
        self.pool = MHATokenToKVPool(
            size=SIZE,
            page_size=1,
            dtype=torch.float32,
            head_num=HEADS,
            head_dim=DIM,
            layer_num=LAYERS,
            device="cpu",
            enable_memory_saver=False,
        )
        self.alloc = TokenToKVPoolAllocator(
            size=SIZE, dtype=torch.float32, device="cpu", kvcache=self.pool, need_sort=False
        )
        self.rows = ReqToTokenPool(size=8, max_context_len=256, device="cpu", enable_memory_saver=False)
        self.cache = VeriCacheRadixCache(
            CacheInitParams(
                disable=False, req_to_token_pool=self.rows, token_to_kv_pool_allocator=self.alloc, page_size=1
            )
        )
        self.gen = torch.Generator().manual_seed(0)
        self.kv: dict[str, list[torch.Tensor]] = {}  # rid -> per layer [tokens, 2, heads, dim] written

    def request(self, rid: str, prompt: list[int], prefix: int = 0) -> Req:
        """A prefilled request: ``prefix`` tokens matched in the tree (and locked), the rest its own."""
        req = Req(rid, "", array("l", prompt), SamplingParams(max_new_tokens=64))
        self.rows.alloc([req])
        if prefix:
            match = self.cache.match_prefix(MatchPrefixParams(key=RadixKey(prompt[:prefix])))
            assert match.device_prefix_len == prefix
            indices = self.cache.path_device_indices(match.last_device_node)
            self.rows.write((req.kv.req_pool_idx, slice(0, prefix)), indices.to(torch.int32))
            req.lock, req.last_node = self.cache.lock(match.last_device_node), match.last_device_node
            req.kv.cache_protected_len = prefix
            self.kv[rid] = [t[:prefix].clone() for t in self.kv["_prefix"]]  # set by the test
        self.extend(req, len(prompt) - prefix)
        return req

    def extend(self, req: Req, n: int) -> torch.Tensor:
        """``n`` new tokens with KV (a prefill or a verify pass writing them); commits them."""
        start = req.kv.kv_committed_len if req.kv.kv_committed_len else req.kv.cache_protected_len
        slots = self.alloc.alloc(n)
        self.rows.write((req.kv.req_pool_idx, slice(start, start + n)), slots.to(torch.int32))
        old = self.kv.get(req.rid, [torch.empty(0, 2, HEADS, DIM)] * LAYERS)
        new = []
        for layer in range(LAYERS):
            kv = torch.randn(n, 2, HEADS, DIM, generator=self.gen)
            self.pool.k_buffer[layer][slots], self.pool.v_buffer[layer][slots] = kv[:, 0], kv[:, 1]
            new.append(torch.cat([old[layer], kv]))
        self.kv[req.rid] = new
        req.kv.kv_committed_len = req.kv.kv_allocated_len = start + n
        return slots

    def seen(self, req: Req) -> list[torch.Tensor]:
        """What a verify pass reads for ``req``: its row, through the pool's waiting accessors."""
        row = self.rows.req_to_token[req.kv.req_pool_idx, : req.kv.kv_committed_len].to(torch.int64)
        return [
            torch.stack([self.pool.get_key_buffer(layer)[row], self.pool.get_value_buffer(layer)[row]], 1)
            for layer in range(LAYERS)
        ]

    def same(self, req: Req) -> bool:
        return all(torch.equal(a, b) for a, b in zip(self.seen(req), self.kv[req.rid], strict=True))


def _host(setup: Setup, **cfg) -> tuple[FullKVOffload, list[str]]:
    released: list[str] = []
    runner = SimpleNamespace(
        token_to_kv_pool=setup.pool, req_to_token_pool=setup.rows, token_to_kv_pool_allocator=setup.alloc
    )  # a holder of SGLang's real pools
    host = FullKVOffload(VeriCacheConfig(full_kv="host", horizon=4, **cfg), runner, setup.alloc, released.append)
    return host, released


def _verify_reading(s: Setup, req: Req, seen: list[bool]):
    """A stand-in for the verify pass (the model cannot run here): records whether the pass would
    read exactly ``req``'s full KV, and returns logits of the right shape."""

    def verify(rows: torch.Tensor) -> torch.Tensor:
        seen.append(s.same(req))
        return torch.zeros(len(rows) * 5, 3)

    return verify


def _grouped_reading(s: Setup, reqs: list[Req], groups: list[list[int]]):
    """The verify-pass stand-in for a batch: records each group, checks every request in it reads
    its exact full KV, and returns logits whose every row is the request's batch index."""

    def verify(rows: torch.Tensor) -> torch.Tensor:
        groups.append(rows.tolist())
        assert all(s.same(reqs[i]) for i in rows.tolist())
        return rows.repeat_interleave(5).float()[:, None].repeat(1, 2)

    return verify


def _plan_and_draft(host: FullKVOffload, reqs: list[Req]) -> None:
    """One step's plan and its ``horizon`` draft passes (each an iteration of the plan)."""
    host.plan(reqs)
    for _ in range(host.horizon):
        host.draft_pass(lambda: torch.zeros(1))


def _verified_exactly(host: FullKVOffload, s: Setup, req: Req) -> bool:
    """The step's verification of ``req`` alone: whether its one pass read exactly its full KV."""
    seen: list[bool] = []
    host.verify([req], _verify_reading(s, req, seen), width=5)
    return seen == [True]


def _finish(req: Req) -> None:
    req.finished_reason = FINISH_LENGTH(len(req.output_ids))
    req.finished_len = len(req.output_ids)


def test_a_request_decodes_with_its_rows_on_the_host_and_sglang_frees_them_once():
    s = Setup()
    host, released = _host(s, reload_room=0.25)  # 128 arena slots
    total = s.alloc.available_size()
    req = s.request("a", list(range(1, 61)))
    assert host.offload(req, 60) == 60
    assert offload_for(s.alloc) is host.ledger and req.skip_radix_cache_insert
    row = s.rows.req_to_token[req.kv.req_pool_idx]
    assert bool((row[:60] == PAD_SLOT).all())  # the device holds none of it
    assert s.alloc.available_size() == total - host.arena_slots  # its 60 slots back, the arena taken
    for step in range(3):
        _plan_and_draft(host, [req])
        assert "a" in host.reloads.inflight  # its reload started while drafting ran
        assert _verified_exactly(host, s, req), f"step {step}: the verify pass did not read the exact full KV"
        assert bool((row[: req.kv.kv_committed_len] == PAD_SLOT).all())  # lent slots returned
        assert host.arena.available_size() == host.arena_slots
        s.extend(req, 3)  # the verify pass committed 3 tokens
        req.output_ids.extend([7, 7, 7])
        assert host.offload(req, req.kv.kv_committed_len) == 3
    # SGLang finishes it: its own release path, through the radix cache's free_kv_row/on_release
    s.extend(req, 2)  # two more slots the scheduler had allocated past the stop (overallocated)
    req.kv.kv_committed_len -= 2
    _finish(req)
    release_kv_cache(req, s.cache, checkpoint=True)
    assert released == ["a"] and "a" not in host.ledger and host.arena is None
    assert s.alloc.available_size() == total  # every slot back once: offloaded, resident and arena
    assert host.tier.available_tokens() == host.tier.host_pool.size


def test_a_matched_prefix_stays_with_the_tree_and_only_the_requests_own_rows_move():
    s = Setup()
    host, _ = _host(s)
    total = s.alloc.available_size()
    prompt = list(range(100, 148))
    first = s.request("first", prompt[:20])
    s.cache.insert(
        InsertParams(key=RadixKey(prompt[:20]), value=s.rows.req_to_token[first.kv.req_pool_idx, :20].to(torch.int64))
    )
    s.kv["_prefix"] = [t.clone() for t in s.kv["first"]]
    req = s.request("b", prompt, prefix=20)
    assert host.offload(req, 48) == 28  # only [20, 48): the prefix is the tree's
    _plan_and_draft(host, [req])
    assert _verified_exactly(host, s, req)
    _finish(req)
    release_kv_cache(req, s.cache, checkpoint=True)
    s.rows.free(first)  # the tree owns its 20 slots
    s.cache.evict(EvictParams(num_tokens=SIZE))
    assert s.alloc.available_size() == total


def test_groups_verify_one_after_another_in_the_reload_room():
    """Six requests whose full KV together is three times the reload room: every verification
    in a step reads exact KV, and no group needs more than the room."""
    s = Setup()
    host, _ = _host(s, reload_room=0.25)  # 128 slots; each request holds 60
    total = s.alloc.available_size()
    reqs = [s.request(f"r{i}", list(range(1000 * i, 1000 * i + 60))) for i in range(6)]
    for req in reqs:
        host.offload(req, 60)
    for step in range(3):
        _plan_and_draft(host, reqs)
        groups: list[list[int]] = []
        logits = host.verify(reqs, _grouped_reading(s, reqs, groups), width=5)
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
    host, _ = _host(s, reload_room=0.1)  # 51 arena slots
    req = s.request("big", list(range(1, 81)))
    assert host.offload(req, 80) == host.arena_slots
    row = s.rows.req_to_token[req.kv.req_pool_idx]
    assert bool((row[: host.arena_slots] == PAD_SLOT).all()) and bool((row[host.arena_slots : 80] != PAD_SLOT).all())
    _plan_and_draft(host, [req])
    assert _verified_exactly(host, s, req)


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


# -- full_kv "store": the same offload over the full-KV store (a real embedded store; faults injected
# around it by tests/faults.py), fetched on the tier's thread while the draft passes run


def _store(setup: Setup, backend=None, **cfg) -> tuple[FullKVOffload, list[BaseException]]:
    from remote_store import open_store
    from vericache_sglang.full_kv.store import FullKVStore
    from vericache_sglang.sglang.full_kv.store_tier import StoreFullKV
    from vericache_sglang.sglang.pool_kv import pool_layout

    runner = SimpleNamespace(
        token_to_kv_pool=setup.pool, req_to_token_pool=setup.rows, token_to_kv_pool_allocator=setup.alloc
    )
    store = FullKVStore(backend or open_store("memory://"), pool_layout(setup.pool, "test"), chunk_tokens=16)
    errors: list[BaseException] = []
    offload = FullKVOffload(
        VeriCacheConfig(full_kv="store", horizon=4, **cfg),
        runner,
        setup.alloc,
        lambda rid: None,
        tier=StoreFullKV(setup.pool, store),
        on_error=errors.append,
    )
    return offload, errors


def _recompute_from(s: Setup, req: Req, calls: list[tuple[int, int, int]]):
    """A stand-in for the worker's recompute pass (the model cannot run here): writes the request's
    exact KV of positions from ``start`` into the lent slots, as the pass over its tokens would."""

    def recompute(i: int, start: int, slots: torch.Tensor) -> None:
        calls.append((i, start, int(slots.numel())))
        for layer in range(LAYERS):
            kv = s.kv[req.rid][layer][start : start + slots.numel()]
            s.pool.k_buffer[layer][slots], s.pool.v_buffer[layer][slots] = kv[:, 0], kv[:, 1]

    return recompute


def test_with_the_full_kv_only_in_the_store_every_verification_reads_it_exactly():
    s = Setup()
    offload, errors = _store(s, reload_room=0.25)
    total = s.alloc.available_size()
    req = s.request("a", list(range(1, 61)))
    assert offload.admit(req, 60) == 60
    row = s.rows.req_to_token[req.kv.req_pool_idx]
    assert bool((row[:60] == PAD_SLOT).all())  # the device holds none of it
    handle = offload.tier._handles["a"]
    assert handle.stored == 60 and offload.offloaded_bytes == 60 * offload.tier.bytes_per_token
    for step in range(3):
        _plan_and_draft(offload, [req])
        assert "a" in offload.reloads.inflight  # its fetch started while drafting ran
        seen: list[bool] = []
        offload.verify([req], _verify_reading(s, req, seen), width=5, recompute=_recompute_from(s, req, []))
        assert seen == [True], f"step {step}: the verify pass did not read the exact full KV"
        s.extend(req, 3)
        req.output_ids.extend([7, 7, 7])
        assert offload.offload(req, req.kv.kv_committed_len, [7, 7, 7]) == 3
    assert offload.reloaded_bytes == (60 + 63 + 66) * offload.tier.bytes_per_token and not errors
    _finish(req)
    release_kv_cache(req, s.cache, checkpoint=True)
    assert s.alloc.available_size() == total and "a" not in offload.tier and handle.unreleased == 0


def test_a_fetch_the_store_does_not_deliver_is_recomputed_before_the_verify_pass():
    """The store fails mid-fetch, then returns a corrupt record: each time the request's positions
    are recomputed into the lent slots (never read as fetched), the pass reads exact KV, counted."""
    from faults import HookedStore

    from remote_store import StoreError, open_store

    failing = {"on": False}

    def hook(count: int) -> None:
        if failing["on"]:
            raise StoreError(f"injected failure on get #{count}")

    s = Setup()
    offload, errors = _store(s, HookedStore(open_store("memory://"), hook))
    req = s.request("a", list(range(1, 41)))
    assert offload.admit(req, 40) == 40
    calls: list[tuple[int, int, int]] = []
    failing["on"] = True
    _plan_and_draft(offload, [req])
    seen: list[bool] = []
    offload.verify([req], _verify_reading(s, req, seen), width=5, recompute=_recompute_from(s, req, calls))
    assert seen == [True] and calls == [(0, 0, 40)] and offload.recomputed == 1
    assert isinstance(errors[-1], StoreError)
    failing["on"] = False
    backend = offload.tier.store.backend.inner
    for key in offload.tier._handles["a"]._pinned:  # every record of the request, garbled
        backend.put_many([(key, b"not a chunk")])
    _plan_and_draft(offload, [req])
    seen = []
    offload.verify([req], _verify_reading(s, req, seen), width=5, recompute=_recompute_from(s, req, calls))
    assert seen == [True] and calls == [(0, 0, 40)] * 2 and offload.recomputed == 2
    # with nothing to recompute it, a verification refuses to run rather than read what was not fetched
    _plan_and_draft(offload, [req])
    with pytest.raises(RuntimeError, match="not delivered"):
        offload.verify([req], _verify_reading(s, req, []), width=5)


def test_a_store_that_refuses_the_writes_leaves_the_request_on_the_device():
    from faults import HookedStore

    from remote_store import StoreError, open_store

    class Refusing(HookedStore):
        def put_many(self, items, ttl_s=None):
            raise StoreError("injected: the store is down")

    s = Setup()
    offload, errors = _store(s, Refusing(open_store("memory://"), lambda n: None))
    req = s.request("a", list(range(1, 41)))
    assert offload.admit(req, 40) == 0 and len(errors) == 1
    row = s.rows.req_to_token[req.kv.req_pool_idx]
    assert bool((row[:40] != PAD_SLOT).all())  # still on the device, still exact
    offload.plan([req])
    seen: list[bool] = []
    offload.verify([req], _verify_reading(s, req, seen), width=5)
    assert seen == [True]


def test_a_matched_prefix_is_written_to_the_store_for_other_servers_and_stays_with_the_tree():
    s = Setup()
    offload, _ = _store(s)
    prompt = list(range(100, 148))
    first = s.request("first", prompt[:32])
    s.cache.insert(
        InsertParams(key=RadixKey(prompt[:32]), value=s.rows.req_to_token[first.kv.req_pool_idx, :32].to(torch.int64))
    )
    s.kv["_prefix"] = [t.clone() for t in s.kv["first"]]
    req = s.request("b", prompt, prefix=32)
    assert offload.admit(req, 48) == 16  # only [32, 48) leaves the device: the prefix is the tree's
    store = offload.tier.store
    assert store.longest_prefix(prompt) == 48  # every whole chunk of the prompt, prefix included
    kv = store.load_prefix(prompt, 48)
    for layer in range(LAYERS):
        k, v = kv.layers[layer]
        assert torch.equal(k.transpose(0, 1), s.kv["b"][layer][:, 0]) and torch.equal(
            v.transpose(0, 1), s.kv["b"][layer][:, 1]
        )
    _plan_and_draft(offload, [req])
    seen: list[bool] = []
    offload.verify([req], _verify_reading(s, req, seen), width=5)
    assert seen == [True]


def test_a_prompt_prefix_in_the_store_is_loaded_into_the_tree_for_the_next_request():
    """The first request's prompt went to the store (it stays out of the tree); the next request
    over the same document finds it through SGLang's own prefix match: the prefix's KV is loaded
    into device slots, exactly, and inserted into the tree. A corrupt record is a plain miss."""
    from sglang.srt.mem_cache.common import match_kv_cache

    s = Setup()
    offload, _ = _store(s, reload_room=0.5)
    document = list(range(500, 628))  # eight chunks of 16
    first = s.request("first", [*document, 1, 2, 3])
    assert offload.admit(first, 131) == 131
    # the match leaves the prompt's last 64 tokens to compute (the observation window): 66 -> 64
    second = Req("second", "", array("l", [*document, 4, 5]), SamplingParams(max_new_tokens=8))
    match = match_kv_cache(second, s.cache, second.origin_input_ids)
    assert match.device_prefix_len == 64 and offload.tier.prefix_tokens_loaded == 64
    slots = s.cache.path_device_indices(match.last_device_node)
    for layer in range(LAYERS):
        got = torch.stack([s.pool.k_buffer[layer][slots], s.pool.v_buffer[layer][slots]], 1)
        assert torch.equal(got, s.kv["first"][layer][:64])
    assert match_kv_cache(second, s.cache, second.origin_input_ids).device_prefix_len == 64  # the tree's own
    assert offload.tier.prefix_hits == 1
    # another document whose stored records are garbled: nothing is loaded, nothing leaks
    other = s.request("other", list(range(900, 1031)))
    assert offload.admit(other, 131) == 131
    backend = offload.tier.store.backend
    for key in offload.tier._handles["other"]._pinned:
        backend.put_many([(key, b"not a chunk")])
    free = s.alloc.available_size()
    third = Req("third", "", array("l", [*range(900, 1028), 7]), SamplingParams(max_new_tokens=8))
    assert match_kv_cache(third, s.cache, third.origin_input_ids).device_prefix_len == 0
    assert s.alloc.available_size() == free and offload.tier.prefix_errors == 1
    # a request SGLang keeps apart (a cache salt) writes records of its own: nobody else finds them
    salted = s.request("salted", list(range(2000, 2131)))
    salted.cache_salt = "tenant-a"
    assert offload.admit(salted, 131) == 131
    fourth = Req("fourth", "", array("l", [*range(2000, 2128), 7]), SamplingParams(max_new_tokens=8))
    assert match_kv_cache(fourth, s.cache, fourth.origin_input_ids).device_prefix_len == 0
    assert offload.tier.prefix_hits == 1
