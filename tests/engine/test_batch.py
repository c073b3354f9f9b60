"""The batch engine on the tiny model: every mode decodes every request exactly as full-KV
decoding does (lossy aside), within the device budget, with continuous batching."""

import gc
import weakref

import pytest
import torch
from faults import HookedStore, failing_from

from remote_store.backends.memory import MemoryStore
from remote_store.link import LinkEmulator
from vericache_sglang.core.compress import parse_spec
from vericache_sglang.core.sampling import SamplingParams
from vericache_sglang.engine.batch import BatchEngine
from vericache_sglang.engine.batch_jobs import BatchConfig
from vericache_sglang.engine.decode import GenerationConfig, generate_full
from vericache_sglang.engine.engine import compare
from vericache_sglang.engine.fetch import FullKVFetch
from vericache_sglang.engine.prefill import prefill
from vericache_sglang.engine.request import VeriCacheRequest
from vericache_sglang.full_kv.store import FullKVStore

SPEC = "snapkv:ratio=0.25,window=16"


@pytest.fixture(scope="module")
def pres(tiny_runner):
    g = torch.Generator().manual_seed(5)
    return [
        prefill(tiny_runner, torch.randint(0, 512, (int(n),), generator=g).tolist()) for n in (300, 250, 320, 280, 310)
    ]


def gen(**kw):
    return GenerationConfig(**{"max_new_tokens": 24, "horizon": 6, "keep_logits": True, **kw})


@pytest.fixture(scope="module")
def refs(tiny_runner, pres):
    return [generate_full(tiny_runner, p, gen()) for p in pres]


def run_batch(
    runner,
    pres,
    mode,
    schedule="staggered",
    budget_units=2.5,
    cfg=None,
    link_bytes_s=5e8,
    spec=SPEC,
    backend=None,
    **batch,
):
    unit = (320 + 24) * runner.layout.bytes_per_token
    store = FullKVStore(LinkEmulator(backend or MemoryStore(), link_bytes_s), runner.layout, chunk_tokens=32)
    engine = BatchEngine(
        runner,
        store,
        parse_spec(spec),
        BatchConfig(mode=mode, schedule=schedule, kv_budget_bytes=int(budget_units * unit), window=48, **batch),
        cfg or gen(),
    )
    for i, p in enumerate(pres):
        engine.submit(p, f"r{i}")
    out = engine.run()
    return [out[f"r{i}"] for i in range(len(pres))], engine


@pytest.mark.parametrize(
    "mode,schedule",
    [
        ("full_resident", "staggered"),
        ("full_offloaded", "staggered"),
        ("vericache", "lockstep"),
        ("vericache", "staggered"),
    ],
)
def test_every_exact_mode_is_identical_to_full_kv(tiny_runner, pres, refs, mode, schedule, exactness):
    outs, engine = run_batch(tiny_runner, pres, mode, schedule)
    for i, (ref, out) in enumerate(zip(refs, outs, strict=True)):
        cmp = compare(ref, out)
        exactness(f"tiny batch {mode}/{schedule} request {i}", cmp)
        assert cmp["identical"], (i, cmp)
    assert engine.stats.peak_device_bytes <= engine.batch.kv_budget_bytes
    assert engine.stats.generated_tokens == 5 * 24


@pytest.mark.parametrize("schedule", ["lockstep", "staggered"])
def test_drafting_modifiers_in_a_batch_are_identical_to_full_kv(tiny_runner, pres, refs, schedule, exactness):
    """Refresh and trusted lookup chains (multi-token draft segments) batched with other requests."""
    spec = "snapkv:ratio=0.125,window=16+refresh:ratio=0.125+lookup:min_ngram=1,trust=1"
    outs, _ = run_batch(tiny_runner, pres, "vericache", schedule, spec=spec)
    for i, (ref, out) in enumerate(zip(refs, outs, strict=True)):
        cmp = compare(ref, out)
        exactness(f"tiny batch {schedule} {spec} request {i}", cmp)
        assert cmp["identical"], (i, cmp)
    assert sum(o.stats.lookup_drafted for o in outs) > 0


def test_budget_limits_resident_concurrency_more_than_vericache(tiny_runner, pres):
    _, resident = run_batch(tiny_runner, pres, "full_resident", budget_units=2.5)
    _, vericache = run_batch(tiny_runner, pres, "vericache", "staggered", budget_units=2.5)
    assert resident.stats.peak_running == 2  # two full KVs fit
    # Every compressed KV would fit with one reload's room, but the batch keeps room for as many
    # reloads as its verifications need at once, so it runs more than resident and fewer than all.
    assert 2 < vericache.stats.peak_running < 5
    _, roomy = run_batch(tiny_runner, pres, "vericache", "staggered", budget_units=20)
    assert roomy.stats.peak_running == 5


def test_reloads_needed_grow_with_the_batch_and_the_reload_span(tiny_runner, pres):
    from vericache_sglang.core.schedule import StaggeredScheduler
    from vericache_sglang.engine.batch_jobs import Job

    store = FullKVStore(MemoryStore(), tiny_runner.layout, chunk_tokens=32)
    engine = BatchEngine(tiny_runner, store, parse_spec(SPEC), BatchConfig(), gen(horizon=7))
    job = Job("r", pres[0], gen(horizon=7), parse_spec(SPEC))
    size = engine._full_reserve(job)
    # a reload of one iteration (1.5 with the slack: spans 2) holds its memory 3 of every 8 iterations
    sched = StaggeredScheduler(64, iteration_s=1.0, link_bytes_s=size, memory_capacity=1 << 40)
    assert [engine._reloads_needed(sched, n, job) for n in (1, 2, 3, 8)] == [1, 1, 2, 3]
    slow = StaggeredScheduler(64, iteration_s=1.0, link_bytes_s=size / 4, memory_capacity=1 << 40)  # spans 6
    assert [engine._reloads_needed(slow, n, job) for n in (1, 2, 8)] == [1, 2, 7]


def test_staggered_verifications_spread_while_lockstep_bunches(tiny_runner, pres):
    # A slow link (each reload takes several iterations): the link ring allows one reload at a time.
    _, lock = run_batch(tiny_runner, pres, "vericache", "lockstep", budget_units=20, link_bytes_s=2e7)
    _, stag = run_batch(tiny_runner, pres, "vericache", "staggered", budget_units=20, link_bytes_s=2e7)
    assert lock.stats.peak_running == stag.stats.peak_running == 5
    assert lock.stats.max_verifies_per_iteration == 5  # all five reloads land on the link together
    assert stag.stats.max_verifies_per_iteration < 5


def test_a_late_verification_waits_at_the_horizon_unless_told_to_draft_on(tiny_runner, pres, refs):
    # A slow link pushes verifications past the horizon (6): by default a request stops drafting
    # there; with draft_until_verify it drafts up to its verification. Both stay exact.
    stopped, _ = run_batch(tiny_runner, pres, "vericache", budget_units=20, link_bytes_s=2e7)
    assert max(max(o.stats.drafted) for o in stopped) == 6
    drafting, _ = run_batch(tiny_runner, pres, "vericache", budget_units=20, link_bytes_s=2e7, draft_until_verify=True)
    assert max(max(o.stats.drafted) for o in drafting) > 6
    for ref, a, b in zip(refs, stopped, drafting, strict=True):
        assert compare(ref, a)["identical"] and compare(ref, b)["identical"]


def test_seeded_sampling_in_a_batch_is_identical(tiny_runner, pres, exactness):
    cfg = gen(sampling=SamplingParams(temperature=0.8, seed=3))
    refs = [generate_full(tiny_runner, p, cfg) for p in pres[:3]]
    outs, _ = run_batch(tiny_runner, pres[:3], "vericache", "staggered", cfg=cfg)
    for ref, out in zip(refs, outs, strict=True):
        cmp = compare(ref, out)
        exactness("tiny batch sampled T=0.8 staggered", cmp)
        assert cmp["identical"], cmp


def test_a_request_larger_than_the_budget_is_a_clear_error(tiny_runner, pres):
    with pytest.raises(ValueError, match="budget"):
        run_batch(tiny_runner, pres[:1], "full_resident", budget_units=0.5)
    with pytest.raises(ValueError, match="unknown mode"):
        BatchConfig(mode="fast")


@pytest.mark.parametrize(
    "mode,schedule", [("full_resident", "staggered"), ("vericache", "staggered"), ("vericache", "lockstep")]
)
def test_requests_done_at_their_first_token_leave_cleanly(tiny_runner, pres, mode, schedule):
    outs, _ = run_batch(tiny_runner, pres[:2], mode, schedule, cfg=gen(max_new_tokens=1))
    assert [len(o.tokens) for o in outs] == [1, 1]


@pytest.mark.parametrize("mode", ["vericache", "lossy"])
def test_each_prompt_is_compressed_once(tiny_runner, pres, refs, mode):
    """Sizing a job compresses its prompt; the request that starts it takes that compressed KV."""
    from vericache_sglang.core.compress.drop.snapkv import SnapKV

    class CountingSnapKV(SnapKV):  # the real compressor, counting its calls
        calls = 0

        def compress(self, full, obs=None):
            CountingSnapKV.calls += 1
            return super().compress(full, obs)

    store = FullKVStore(MemoryStore(), tiny_runner.layout, chunk_tokens=32)
    engine = BatchEngine(
        tiny_runner,
        store,
        CountingSnapKV(ratio=0.25, window=16),
        BatchConfig(mode=mode, kv_budget_bytes=1 << 28),
        gen(),
    )
    for i, p in enumerate(pres):
        engine.submit(p, f"r{i}")
    results = engine.run()
    assert CountingSnapKV.calls == len(pres)
    if mode == "vericache":
        assert all(compare(refs[i], results[f"r{i}"])["identical"] for i in range(len(pres)))


@pytest.mark.parametrize("schedule,store_fails", [("lockstep", False), ("staggered", False), ("staggered", True)])
def test_a_finished_batch_is_freed_without_the_cycle_collector(tiny_runner, pres, refs, schedule, store_fails):
    # A server runs for days: a finished request's full KV (its last fetch's buffers, 175 MB at
    # 4K tokens of SmolLM2) must go when the request does, not at some later full collection;
    # benchmarks that ran batch after batch grew by GBs and slowed in the kernel's reclaim. A
    # fetch that failed (the request recomputed its full KV) keeps its error, whose frames held
    # the fetch's buffers and the request.
    gc.collect()
    gc.disable()
    try:
        first_verify_gets = 2 * tiny_runner.layout.num_layers + 2  # one get of a fetch fails
        backend = (
            HookedStore(MemoryStore(), failing_from(first_verify_gets, until=first_verify_gets))
            if store_fails
            else None
        )
        outs, engine = run_batch(tiny_runner, pres[:3], "vericache", schedule, backend=backend)
        assert [o.tokens for o in outs] == [r.tokens for r in refs[:3]]
        assert sum(o.stats.store_fallbacks for o in outs) == int(store_fails)
        freed = weakref.ref(engine)
        del outs, engine
        assert freed() is None
        assert not [o for o in gc.get_objects() if isinstance(o, (FullKVFetch, VeriCacheRequest))]
    finally:
        gc.enable()
