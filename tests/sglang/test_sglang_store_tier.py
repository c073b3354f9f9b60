"""``full_kv: "store"`` on SGLang's own objects (CPU): the same offload as the host tier's over the
full-KV store (a real embedded store; faults injected around it by ``tests/faults.py``), fetched on
the tier's thread while the draft passes run; a fetch the store does not deliver is recomputed, a
write it refuses leaves the request on the device, and prompt prefixes in the store are loaded into
the radix tree for the next request, on this server or another."""

from __future__ import annotations

from array import array

import pytest
import torch

pytest.importorskip("sglang.srt.mem_cache.l2_transfer", reason="sglang is not installed")

from offload_setup import (
    LAYERS,
    Setup,
    finish,
    plan_and_draft,
    published_server_args,  # noqa: F401  (autouse: SGLang's published server args)
    recompute_from,
    store_offload,
    verify_reading,
)
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.mem_cache.base_prefix_cache import EvictParams
from sglang.srt.mem_cache.common import release_kv_cache
from sglang.srt.sampling.sampling_params import SamplingParams

from vericache_sglang.sglang.full_kv.offload_rows import PAD_SLOT


def test_with_the_full_kv_only_in_the_store_every_verification_reads_it_exactly():
    s = Setup()
    offload, errors = store_offload(s, reload_room=0.25)
    total = s.alloc.available_size()
    req = s.request("a", list(range(1, 61)))
    assert offload.admit(req, 60) == 60
    row = s.rows.req_to_token[req.kv.req_pool_idx]
    assert bool((row[:60] == PAD_SLOT).all())  # the device holds none of it
    handle = offload.tier._handles["a"]
    assert handle.stored == 60 and offload.offloaded_bytes == 60 * offload.tier.bytes_per_token
    for step in range(3):
        plan_and_draft(offload, [req])
        assert "a" in offload.reloads.inflight  # its fetch started while drafting ran
        seen: list[bool] = []
        offload.verify([req], verify_reading(s, req, seen), width=5, recompute=recompute_from(s, req, []))
        assert seen == [True], f"step {step}: the verify pass did not read the exact full KV"
        s.extend(req, 3)
        req.output_ids.extend([7, 7, 7])
        assert offload.offload(req, req.kv.kv_committed_len, [7, 7, 7]) == 3
    assert offload.reloaded_bytes == (60 + 63 + 66) * offload.tier.bytes_per_token and not errors
    finish(req)
    release_kv_cache(req, s.cache, checkpoint=True)
    assert s.alloc.available_size() == total and "a" not in offload.tier and handle.unreleased == 0


def test_a_retracted_request_prefilling_again_over_its_outputs_goes_to_the_store_whole():
    """SGLang retracts a request under memory pressure and later prefills it again over its prompt
    and the tokens it had generated: all of them are the request's known tokens, offloaded and read
    back exactly (they were once only the prompt's, and the store refused the rest)."""
    s = Setup()
    offload, errors = store_offload(s, reload_room=0.25)
    req = s.request("a", list(range(1, 41)))
    req.output_ids.extend([7, 8, 9])
    s.extend(req, 3)  # the re-prefill computed the outputs' KV too
    assert offload.admit(req, 43) == 43 and not errors
    assert offload.tier._handles["a"].stored == 43
    plan_and_draft(offload, [req])
    seen: list[bool] = []
    offload.verify([req], verify_reading(s, req, seen), width=5, recompute=recompute_from(s, req, []))
    assert seen == [True] and not errors


def test_a_fetch_the_store_does_not_deliver_is_recomputed_before_the_verify_pass():
    """The store fails mid-fetch, then returns a corrupt record, both known by the time the verify
    pass is due: each time the request's positions are recomputed into the lent slots (never read as
    fetched) before the pass, which reads exact KV once, counted."""
    from faults import HookedStore

    from remote_store import StoreError, open_store

    failing = {"on": False}

    def hook(count: int) -> None:
        if failing["on"]:
            raise StoreError(f"injected failure on get #{count}")

    s = Setup()
    offload, errors = store_offload(s, HookedStore(open_store("memory://"), hook))
    req = s.request("a", list(range(1, 41)))
    assert offload.admit(req, 40) == 40
    calls: list[tuple[int, int, int]] = []
    failing["on"] = True
    plan_and_draft(offload, [req])
    offload.tier._jobs["a"].exception()  # the fetch has failed before the pass is due
    seen: list[bool] = []
    offload.verify([req], verify_reading(s, req, seen), width=5, recompute=recompute_from(s, req, calls))
    assert seen == [True] and calls == [(0, 0, 40)] and offload.recomputed == 1
    assert isinstance(errors[-1], StoreError)
    failing["on"] = False
    backend = offload.tier.store.backend.inner
    for key in offload.tier._handles["a"]._pinned:  # every record of the request, garbled
        backend.put_many([(key, b"not a chunk")])
    plan_and_draft(offload, [req])
    offload.tier._jobs["a"].exception()
    seen = []
    offload.verify([req], verify_reading(s, req, seen), width=5, recompute=recompute_from(s, req, calls))
    assert seen == [True] and calls == [(0, 0, 40)] * 2 and offload.recomputed == 2
    # with nothing to recompute it, a verification refuses to run rather than read what was not fetched
    plan_and_draft(offload, [req])
    with pytest.raises(RuntimeError, match="not delivered"):
        offload.verify([req], verify_reading(s, req, []), width=5)


def _fetch_held_at_its_second_layer(fail: bool):
    """A store whose fetch delivers layer 0, then holds layer 1 until the verify pass has started
    (``started``), then delivers it or, with ``fail``, fails."""
    import threading

    from faults import HookedStore

    from remote_store import StoreError, open_store

    started, armed = threading.Event(), {"on": False}

    def hook(count: int) -> None:
        if armed["on"] and count == armed["start"] + 2:
            assert started.wait(10), "the verify pass never started"
            if fail:
                raise StoreError("injected failure at layer 1")

    return HookedStore(open_store("memory://"), hook), started, armed


@pytest.mark.parametrize("fail", [False, True], ids=["delivered", "failed-mid-pass"])
def test_the_verify_pass_starts_on_the_first_fetched_layer(fail):
    """The verify pass reads the request's reload per layer as it arrives (the pool's waiting
    accessors wait on the tier's ``LayerLoads``): it starts while the fetch still holds layer 1 and
    reads exact KV. Where the fetch then fails, the positions are recomputed and the pass runs
    again over them: its first reading is discarded, never used."""
    backend, started, armed = _fetch_held_at_its_second_layer(fail)
    s = Setup()
    offload, errors = store_offload(s, backend)
    req = s.request("a", list(range(1, 41)))
    assert offload.admit(req, 40) == 40
    armed.update(on=True, start=backend.gets)
    layers_in: list[int] = []
    seen: list[bool] = []

    def verify(rows: torch.Tensor) -> torch.Tensor:
        if not started.is_set():
            layers_in.append(offload.tier._fetches["a"].layers_done)
            started.set()
        seen.append(s.same(req))  # through get_key_buffer: waits per layer
        return torch.zeros(len(rows) * 5, 3)

    calls: list[tuple[int, int, int]] = []
    plan_and_draft(offload, [req])
    offload.verify([req], verify, width=5, recompute=recompute_from(s, req, calls))
    assert layers_in and layers_in[0] < LAYERS  # the pass started before the whole fetch was in
    if fail:
        assert seen == [False, True] and calls == [(0, 0, 40)]
        assert offload.passes_rerun == 1 and offload.recomputed == 1 and len(errors) == 1
    else:
        assert seen == [True] and calls == [] and offload.passes_rerun == 0 and not errors
        # the pass waited at layer 1 for what drafting had not hidden, within the fetch's own time
        assert 0 < offload.tier.verify_wait_s <= offload.tier.fetch_s


def test_a_store_that_refuses_the_writes_leaves_the_request_on_the_device():
    from faults import HookedStore

    from remote_store import StoreError, open_store

    class Refusing(HookedStore):
        def put_many(self, items, ttl_s=None):
            raise StoreError("injected: the store is down")

    s = Setup()
    offload, errors = store_offload(s, Refusing(open_store("memory://"), lambda n: None))
    req = s.request("a", list(range(1, 41)))
    assert offload.admit(req, 40) == 0 and len(errors) == 1
    row = s.rows.req_to_token[req.kv.req_pool_idx]
    assert bool((row[:40] != PAD_SLOT).all())  # still on the device, still exact
    offload.plan([req])
    seen: list[bool] = []
    offload.verify([req], verify_reading(s, req, seen), width=5)
    assert seen == [True]


def test_a_matched_prefix_is_written_to_the_store_and_leaves_the_device_with_the_request():
    """The prefix the request matched in the tree goes to the store (for other servers) and is
    fetched with the request's own positions for each verification: the request unpins it, so the
    tree may evict it mid-request, and every verification still reads the whole row exactly."""
    s = Setup()
    offload, _ = store_offload(s)
    total = s.alloc.available_size()
    prompt = list(range(100, 148))
    first, req = s.over_cached_prefix(prompt, 32)
    s.rows.free(first)  # the tree owns the prefix's 32 slots
    assert s.cache.protected_size() == 32 and s.cache.evictable_size() == 0  # pinned by the request
    assert offload.admit(req, 48) == 16  # written: [32, 48); the prefix was only read for the store
    row = s.rows.req_to_token[req.kv.req_pool_idx]
    assert bool((row[:48] == PAD_SLOT).all()) and req.lock is None and req.kv.cache_protected_len == 0
    assert s.cache.protected_size() == 0 and s.cache.evictable_size() == 32  # the tree's cache now
    assert offload.tier.num_tokens(req.rid) == 48 and offload.prefixes_streamed == 1
    store = offload.tier.store
    assert store.longest_prefix(prompt) == 48  # every whole chunk of the prompt, prefix included
    kv = store.load_prefix(prompt, 48)
    for layer in range(LAYERS):
        k, v = kv.layers[layer]
        assert torch.equal(k.transpose(0, 1), s.kv["b"][layer][:, 0]) and torch.equal(
            v.transpose(0, 1), s.kv["b"][layer][:, 1]
        )
    for step in range(2):
        plan_and_draft(offload, [req])
        seen: list[bool] = []
        offload.verify([req], verify_reading(s, req, seen), width=5)
        assert seen == [True], f"step {step}"
        assert offload.reloaded_bytes == (step + 1) * 48 * offload.tier.bytes_per_token
        s.cache.evict(EvictParams(num_tokens=512))  # the tree lets the prefix go: nothing reads it
        assert s.cache.evictable_size() == 0
    finish(req)
    release_kv_cache(req, s.cache, checkpoint=True)
    assert offload.arena is None and s.alloc.available_size() == total  # every slot back once


def test_a_matched_prefix_stays_pinned_when_one_reload_could_not_carry_the_prompt():
    """A prompt longer than the reload room keeps its matched prefix on the device, pinned by the
    request as SGLang pins it; its own positions move as far as the room allows. Still exact."""
    s = Setup()
    offload, _ = store_offload(s, reload_room=0.08)  # 40 arena slots for a 48-token prompt
    prompt = list(range(100, 148))
    _, req = s.over_cached_prefix(prompt, 32)
    assert offload.admit(req, 48) == 16  # its own [32, 48); the prefix stays the tree's
    assert req.lock is not None and req.kv.cache_protected_len == 32 and offload.prefixes_streamed == 0
    assert s.cache.protected_size() == 32
    plan_and_draft(offload, [req])
    seen: list[bool] = []
    offload.verify([req], verify_reading(s, req, seen), width=5)
    assert seen == [True]


def test_a_matched_prefix_the_store_already_holds_is_adopted_not_written_again():
    """Another server (or this one) wrote the prefix: it is taken in one check, pinned, and only
    the request's own positions are written; verifications still read the whole row exactly."""
    s = Setup()
    offload, _ = store_offload(s)
    prompt = list(range(100, 148))
    _, req = s.over_cached_prefix(prompt, 32)
    store = offload.tier.store
    writer = store.open_request(prompt[:32], request_id="elsewhere")
    writer.write(0, [(t[:, 0].transpose(0, 1), t[:, 1].transpose(0, 1)) for t in s.kv["_prefix"]])
    checks = []
    exists_many = store.backend.exists_many
    store.backend.exists_many = lambda keys: checks.append(len(keys)) or exists_many(keys)
    assert offload.admit(req, 48) == 16
    # one check of the prefix's two chunks (every layer), one of the request's own chunk
    assert checks == [2 * LAYERS, LAYERS]
    assert offload.tier._handles[req.rid].stats.put_bytes < 32 * offload.tier.bytes_per_token
    assert store.longest_prefix(prompt) == 48
    plan_and_draft(offload, [req])
    seen: list[bool] = []
    offload.verify([req], verify_reading(s, req, seen), width=5)
    assert seen == [True]


def test_a_prompt_prefix_in_the_store_is_loaded_into_the_tree_for_the_next_request():
    """The first request's prompt went to the store (it stays out of the tree); the next request
    over the same document finds it through SGLang's own prefix match: device slots are promised to
    the tree at once and the prefix's KV is loaded into them behind, exactly. A load that fails (a
    corrupt record) leaves the tree where no pass read it, and is not promised again."""
    from sglang.srt.mem_cache.common import match_kv_cache

    from vericache_sglang.sglang.step.prefix_repair import PrefixRepair

    s = Setup()
    offload, _ = store_offload(s, reload_room=0.5)
    loads = offload.tier.layer_loads
    document = list(range(500, 628))  # eight chunks of 16
    first = s.request("first", [*document, 1, 2, 3])
    assert offload.admit(first, 131) == 131
    # the match leaves the prompt's last 64 tokens to compute (the observation window): 66 -> 64
    second = Req("second", "", array("l", [*document, 4, 5]), SamplingParams(max_new_tokens=8))
    match = match_kv_cache(second, s.cache, second.origin_input_ids)
    assert match.device_prefix_len == 64 and loads.pending()
    assert PrefixRepair(offload, _never, lambda: s.cache, s.rows).settle(None) is False  # the load ends with the step
    assert offload.tier.prefix_tokens_loaded == 64 and not loads.pending()
    slots = s.cache.path_device_indices(match.last_device_node)
    for layer in range(LAYERS):
        got = torch.stack([s.pool.k_buffer[layer][slots], s.pool.v_buffer[layer][slots]], 1)
        assert torch.equal(got, s.kv["first"][layer][:64])
    assert match_kv_cache(second, s.cache, second.origin_input_ids).device_prefix_len == 64  # the tree's own
    assert offload.tier.prefix_hits == 1 and not loads.pending()
    # another document whose stored records are garbled: promised, failed, out of the tree, nothing leaks
    other = s.request("other", list(range(900, 1031)))
    assert offload.admit(other, 131) == 131
    _garble(offload, "other")
    free = s.alloc.available_size()
    third = Req("third", "", array("l", [*range(900, 1028), 7]), SamplingParams(max_new_tokens=8))
    assert match_kv_cache(third, s.cache, third.origin_input_ids).device_prefix_len == 64
    assert PrefixRepair(offload, _never, lambda: s.cache, s.rows).settle(None) is False
    assert s.alloc.available_size() == free and offload.tier.prefix_errors == 1
    assert match_kv_cache(third, s.cache, third.origin_input_ids).device_prefix_len == 0  # not promised again
    # a request SGLang keeps apart (a cache salt) writes records of its own: nobody else finds them
    salted = s.request("salted", list(range(2000, 2131)))
    salted.cache_salt = "tenant-a"
    assert offload.admit(salted, 131) == 131
    fourth = Req("fourth", "", array("l", [*range(2000, 2128), 7]), SamplingParams(max_new_tokens=8))
    assert match_kv_cache(fourth, s.cache, fourth.origin_input_ids).device_prefix_len == 0
    assert offload.tier.prefix_hits == 1


def test_a_failed_prefix_load_a_prefill_read_is_recomputed_into_its_slots_and_the_pass_runs_again():
    """The prefill batch's request matched a stored prefix whose load then failed: its positions are
    recomputed from the prompt into the promised slots (the worker's recompute pass), exactly, and
    the worker is told to run the pass again; the load is dealt with, counted once."""
    from types import SimpleNamespace

    from sglang.srt.mem_cache.common import match_kv_cache

    from vericache_sglang.sglang.step.prefix_repair import PrefixRepair

    s = Setup()
    offload, _ = store_offload(s, reload_room=0.5)
    doc = s.request("doc", list(range(900, 1031)))
    assert offload.admit(doc, 131) == 131
    _garble(offload, "doc")
    req = Req("q", "", array("l", [*range(900, 1028), 7]), SamplingParams(max_new_tokens=8))
    match = match_kv_cache(req, s.cache, req.origin_input_ids)
    promised = s.cache.path_device_indices(match.last_device_node)
    s.rows.alloc([req])  # the prefill's row: the matched prefix first, as SGLang writes it
    s.rows.write((req.kv.req_pool_idx, slice(0, 64)), promised.to(torch.int32))
    req.prefix_len = 64
    calls: list[tuple[int, int, int]] = []

    def recompute(batch, committed, i, start, slots):  # the worker's recompute pass, as offload_setup's stand-in
        assert batch.reqs[i] is req and int(committed[i]) == 129
        recompute_from(s, doc, calls)(i, start, slots)

    repair = PrefixRepair(offload, recompute, lambda: s.cache, s.rows)
    batch = SimpleNamespace(reqs=[req], seq_lens=torch.tensor([129]))
    assert repair.settle(batch) is True and calls == [(0, 0, 64)] and repair.recomputed == 1
    for layer in range(LAYERS):
        got = torch.stack([s.pool.k_buffer[layer][promised], s.pool.v_buffer[layer][promised]], 1)
        assert torch.equal(got, s.kv["doc"][layer][:64])
    assert repair.settle(batch) is False and offload.tier.prefix_errors == 1  # dealt with: the second pass is plain


def test_the_prefill_pass_reads_a_layer_only_once_every_load_has_delivered_it():
    """``LayerLoads`` as SGLang's pool calls it: outside the prefill pass nothing waits; inside, a
    layer waits for every load in flight to deliver it, and a load that fails releases its waiters."""
    import threading
    import time

    from vericache_sglang.sglang.full_kv.layer_loads import LayerLoads, PrefixLoad

    loads = LayerLoads(num_layers=3)
    load = PrefixLoad(list(range(8)), 0, torch.arange(8))
    loads.add(load)
    loads.wait_until(2)  # not reading: returns at once
    seen: list[int] = []

    def read() -> None:
        with loads.reading():
            for layer in range(3):
                loads.wait_until(layer)
                seen.append(layer)

    reader = threading.Thread(target=read)
    reader.start()
    time.sleep(0.05)
    assert seen == []
    loads.layer_done(load, 0)
    time.sleep(0.05)
    assert seen == [0]
    loads.end(load, RuntimeError("store down"))  # the rest never arrives: the pass goes on, to be run again
    reader.join(timeout=5)
    assert seen == [0, 1, 2]
    assert loads.settle() == [load]


def _never(*args: object) -> None:
    raise AssertionError("nothing was read: nothing to recompute")


def _garble(offload, rid: str) -> None:
    backend = offload.tier.store.backend
    for key in offload.tier._handles[rid]._pinned:
        backend.put_many([(key, b"not a chunk")])
