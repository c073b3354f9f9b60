"""A model-free simulation of the staggered scheduler under random arrivals: the rings never
over-commit the link or the memory, nothing overtakes the queue, and no request starves."""

import random

import pytest

from vericache_sglang.core.schedule import StaggeredScheduler

ITER_S = 0.05
LINK = 1e9  # bytes/s: one iteration moves 50 MB


def simulate(seed: int, iterations: int, arrival_p: float, verifies: int, capacity: int, window: int = 32):
    rng = random.Random(seed)
    s = StaggeredScheduler(window, ITER_S, LINK, capacity)
    active: dict[str, dict] = {}
    order, admitted_order, waits, done = [], [], [], []
    arrivals = 0
    for _ in range(iterations):
        if rng.random() < arrival_p:
            rid = f"r{arrivals}"
            arrivals += 1
            size = int(rng.uniform(0.2, 3.0) * ITER_S * LINK)  # a reload of 0.2 to 3 iterations
            active[rid] = {"size": size, "left": verifies, "since": s.now, "horizon": rng.choice([8, 16, 24])}
            order.append(rid)
            for res in s.admit(rid, size, active[rid]["horizon"] + 1).values():
                admitted_order.append(res.request_id)
                waits.append(s.now - active[res.request_id]["since"])
        for res in s.retry_waiting().values():
            admitted_order.append(res.request_id)
            waits.append(s.now - active[res.request_id]["since"])
        s.check()
        starting = s.reloads_starting()
        assert all(r.verify_at - r.reload_start >= 1 for r in starting)
        for res in s.verifying():
            s.complete(res.request_id)
            info = active[res.request_id]
            info["left"] -= 1
            if info["left"] == 0:
                done.append(res.request_id)
                del active[res.request_id]
                continue
            info["since"] = s.now
            for again in s.admit(res.request_id, info["size"], info["horizon"] + 1).values():
                admitted_order.append(again.request_id)
                waits.append(s.now - active[again.request_id]["since"])
        s.tick()
    return s, order, admitted_order, waits, done, active


@pytest.mark.parametrize("seed", range(5))
def test_rings_never_overcommit_and_nothing_starves(seed):
    s, order, admitted, waits, done, active = simulate(
        seed, 3000, arrival_p=0.05, verifies=6, capacity=int(4 * ITER_S * LINK)
    )
    assert len(done) > 100
    assert max(waits) < 10 * s.window  # every wait is bounded
    # whatever is still active has been waiting a bounded time
    assert all(s.now - a["since"] < 10 * s.window for a in active.values())
    first_admissions = [r for r in dict.fromkeys(admitted)]
    assert first_admissions == order[: len(first_admissions)]  # nobody overtakes the queue


def test_overload_queues_in_order_and_keeps_the_link_serial():
    # Arrivals far beyond what the link can carry: the queue grows, the rings stay within bounds.
    s, order, admitted, _waits, done, _active = simulate(
        7, 600, arrival_p=0.9, verifies=2, capacity=int(3 * ITER_S * LINK)
    )
    first_admissions = list(dict.fromkeys(admitted))
    assert first_admissions == order[: len(first_admissions)]
    assert len(s.waiting) > 0 and len(done) > 10


def test_reloads_finish_before_their_verification_and_stagger():
    s = StaggeredScheduler(window=40, iteration_s=ITER_S, link_bytes_s=LINK, memory_capacity=10**12, slack=1.0)
    size = int(1.5 * ITER_S * LINK)  # 1.5 iterations of link time: spans 2 iterations
    res = [s.admit(f"r{i}", size, 17)[f"r{i}"] for i in range(8)]
    for r in res:
        assert r.verify_at - r.reload_start == 2
        assert r.reload_bytes / LINK <= (r.verify_at - r.reload_start) * ITER_S + 1e-9
    verify_iterations = sorted(r.verify_at for r in res)
    assert len(set(verify_iterations)) == len(res)  # no two verify together: the link would flood
    s.check()


def test_a_reload_longer_than_the_window_takes_the_whole_link_and_waits_for_it():
    s = StaggeredScheduler(window=8, iteration_s=ITER_S, link_bytes_s=LINK, memory_capacity=10**12)
    small = s.admit("small", int(0.5 * ITER_S * LINK), 2)["small"]
    assert s.admit("huge", int(20 * ITER_S * LINK), 4) == {}  # the link is not free for 7 iterations yet
    for _ in range(small.verify_at + 1):
        s.tick()
    huge = s.retry_waiting()["huge"]
    assert huge.verify_at - huge.reload_start == 7 and huge.link_s_per_iteration == ITER_S
    s.check()


def test_measured_bandwidth_changes_the_span():
    s = StaggeredScheduler(window=40, iteration_s=ITER_S, link_bytes_s=LINK, memory_capacity=10**12, slack=1.0)
    size = int(0.9 * ITER_S * LINK)
    assert s.reload_span(size)[0] == 1
    for _ in range(30):
        s.observe_link(size, 3 * 0.9 * ITER_S)  # the link turned out 3x slower than assumed
    assert s.reload_span(size)[0] == 3


def test_slack_plans_reloads_over_more_iterations_with_the_same_link_time():
    tight = StaggeredScheduler(window=40, iteration_s=ITER_S, link_bytes_s=LINK, memory_capacity=10**12, slack=1.0)
    loose = StaggeredScheduler(window=40, iteration_s=ITER_S, link_bytes_s=LINK, memory_capacity=10**12, slack=2.0)
    size = int(1.5 * ITER_S * LINK)
    (span_t, per_t), (span_l, per_l) = tight.reload_span(size), loose.reload_span(size)
    assert (span_t, span_l) == (2, 3)
    assert span_t * per_t == span_l * per_l == size / LINK


def test_memory_ring_holds_what_lands_on_the_device_not_what_the_link_carries():
    # Each reload writes a commit out and reads a full KV in: both cross the link, only the
    # assembled full KV occupies the device. With room for two of those, two are in flight at once.
    read, write = 40_000_000, 60_000_000
    s = StaggeredScheduler(window=40, iteration_s=ITER_S, link_bytes_s=LINK, memory_capacity=2 * read + 1, slack=1.0)
    res = [s.admit(f"r{i}", read + write, 3, device_bytes=read)[f"r{i}"] for i in range(4)]
    spans = [(r.reload_start, r.verify_at) for r in res]
    assert all(r.device_bytes == read for r in res)
    assert max(sum(a <= i <= b for a, b in spans) for i in range(40)) == 2  # two in flight, never three
    s.check()
    counted_whole = StaggeredScheduler(
        window=40, iteration_s=ITER_S, link_bytes_s=LINK, memory_capacity=2 * read + 1, slack=1.0
    )
    whole = [counted_whole.admit(f"r{i}", read + write, 3)[f"r{i}"] for i in range(4)]
    assert max(sum(r.reload_start <= i <= r.verify_at for r in whole) for i in range(40)) == 1
    for r in res:
        s.cancel(r.request_id)
    assert s.memory == [0] * s.window and all(abs(x) < 1e-12 for x in s.link)


def test_a_reload_needs_link_bytes_and_nonnegative_device_bytes():
    s = StaggeredScheduler(window=8, iteration_s=ITER_S, link_bytes_s=LINK, memory_capacity=10**9)
    for link_bytes, device_bytes in [(0, 10), (10, -1)]:
        with pytest.raises(ValueError, match="device bytes"):
            s.admit("r", link_bytes, 2, device_bytes=device_bytes)
    # rows held on the device make the link carry less than the device holds
    assert s.admit("r", 10, 2, device_bytes=30)["r"].device_bytes == 30


def test_not_before_keeps_verifications_after_the_drafts():
    """An engine whose requests verify only after all their drafts (the SGLang worker's groups
    within one step) asks for ``not_before``: placements then search only later iterations, and a
    request that fits nowhere that late waits instead of verifying early."""
    s = StaggeredScheduler(window=12, iteration_s=ITER_S, link_bytes_s=LINK, memory_capacity=int(1e12))
    size = int(0.9 * ITER_S * LINK)  # each reload takes most of one iteration's link time
    placed = {}
    for i in range(6):
        placed.update(s.admit(f"r{i}", size, anchor_gap=4, not_before=4))
    # two reloads share the link over two iterations each (slack 1.5): pairs at 4, 6, 8
    assert sorted(r.verify_at for r in placed.values()) == [4, 4, 6, 6, 8, 8]
    s.check()
    # without it, the same requests would spread to both sides of the anchor
    free = StaggeredScheduler(window=12, iteration_s=ITER_S, link_bytes_s=LINK, memory_capacity=int(1e12))
    early = {}
    for i in range(6):
        early.update(free.admit(f"r{i}", size, anchor_gap=4))
    assert min(r.verify_at for r in early.values()) < 4
    # the window ends at iteration 11: a request that must verify at 12 or later waits
    late = StaggeredScheduler(window=12, iteration_s=ITER_S, link_bytes_s=LINK, memory_capacity=int(1e12))
    assert late.admit("x", size, anchor_gap=4, not_before=12) == {}
    assert [w[0] for w in late.waiting] == ["x"]
    late.tick()
    assert "x" in late.retry_waiting()
