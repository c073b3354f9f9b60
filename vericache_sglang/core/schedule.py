"""Staggered verification: when each request verifies, and when its full-KV reload starts.

The paper's ADMIT (§5). A look-ahead window of ``W`` iterations carries two reservation rings:

- link: ``link[i]`` is the link time already reserved in iteration ``i``; the link is serial, so it
  never exceeds one iteration's duration;
- memory: ``memory[i]`` is the full-KV bytes reloaded onto the device and not yet consumed in
  iteration ``i``; it never exceeds the capacity left for reloads.

A reload puts ``B`` bytes on the link (the previous verification's commit written out, then the
rows of the full KV the device does not hold) and holds ``M`` bytes on the device until its
verification (the assembled full KV: a write leaves from KV the device holds anyway, and rows a
compressor keeps exactly are copied in rather than fetched). It takes ``B / link_bandwidth``
seconds and is spread over ``S = ceil(slack * that / iteration_time)`` iterations ending right
before its verify iteration ``d``.

ADMIT tries ``d`` at the anchor (``horizon + 1`` iterations ahead), then one earlier, one later,
two earlier, ... and reserves the first that fits both rings; a request that fits nowhere waits,
and waiting requests are retried first, in arrival order, so none starves. Bandwidth and
iteration time are measured by the engine and fed in, never constants. Engine-independent: the
reference engine's batch uses it, and so does the SGLang worker with ``full_kv`` "store" or "host"
(``vericache_sglang/sglang/full_kv/reloads.py``), whose iterations are its draft passes and verify
groups and whose verifications may not run before their drafts are done (``not_before``).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

_EPS = 1e-9


@dataclass(frozen=True)
class Reservation:
    request_id: str
    reload_start: int  # the iteration the reload begins
    verify_at: int  # the iteration the verify pass runs
    reload_bytes: int  # on the link
    link_s_per_iteration: float  # link time reserved in each iteration of [reload_start, verify_at)
    device_bytes: int  # held on the device from reload_start through verify_at


class StaggeredScheduler:
    def __init__(
        self,
        window: int,
        iteration_s: float,
        link_bytes_s: float,
        memory_capacity: int,
        ema: float = 0.3,
        slack: float = 1.5,
    ):
        if window < 2:
            raise ValueError(f"window must be >= 2 iterations, got {window}")
        self.window = window
        self.now = 0
        self.iteration_s = iteration_s
        self.link_bytes_s = link_bytes_s
        self.memory_capacity = memory_capacity
        self.ema = ema
        # Reloads are planned over ``slack`` times their estimated duration: a reload also spends
        # host time decoding and checking what it moved, and the estimates are averages.
        self.slack = slack
        self.link = [0.0] * window
        self.memory = [0] * window
        # (request id, link bytes, device bytes, anchor gap, earliest verify iteration)
        self.waiting: deque[tuple[str, int, int, int, int]] = deque()
        self.reservations: dict[str, Reservation] = {}

    # measurements
    def observe_iteration(self, seconds: float) -> None:
        self.iteration_s += self.ema * (seconds - self.iteration_s)

    def observe_link(self, nbytes: int, seconds: float) -> None:
        if nbytes > 0 and seconds > 0:
            self.link_bytes_s += self.ema * (nbytes / seconds - self.link_bytes_s)

    def set_memory_capacity(self, nbytes: int) -> None:
        """Device bytes available to in-flight reloads (the budget minus what is resident)."""
        self.memory_capacity = nbytes

    # admission
    def reload_span(self, reload_bytes: int) -> tuple[int, float]:
        """Iterations a reload spans and the link time it takes in each. A reload longer than the
        window can hold takes the whole link for ``window - 1`` iterations and overruns (the
        verify pass then waits for it, and the wait is measured)."""
        seconds = reload_bytes / self.link_bytes_s
        span = max(1, math.ceil(self.slack * seconds / self.iteration_s - _EPS))
        if span > self.window - 1:
            return self.window - 1, self.iteration_s
        return span, seconds / span

    def _fits(self, start: int, verify: int, per_iteration: float, nbytes: int) -> bool:
        for i in range(start, verify):
            if self.link[i % self.window] + per_iteration > self.iteration_s + _EPS:
                return False
        # A reload larger than all the memory left waits until it is the only one in flight.
        need = min(nbytes, self.memory_capacity)
        return all(self.memory[i % self.window] + need <= self.memory_capacity for i in range(start, verify + 1))

    def _try(
        self, request_id: str, reload_bytes: int, device_bytes: int, anchor_gap: int, earliest: int
    ) -> Reservation | None:
        span, per_iteration = self.reload_span(reload_bytes)
        lo = max(self.now + span, earliest)  # the reload starts at the earliest next iteration
        hi = self.now + self.window - 1
        anchor = min(max(self.now + anchor_gap, lo), hi)
        for step in range(2 * self.window):
            d = anchor + (-(step + 1) // 2 if step % 2 else step // 2)  # anchor, -1, +1, -2, +2, ...
            if lo <= d <= hi and self._fits(d - span, d, per_iteration, device_bytes):
                held = min(device_bytes, self.memory_capacity)
                for i in range(d - span, d):
                    self.link[i % self.window] += per_iteration
                for i in range(d - span, d + 1):
                    self.memory[i % self.window] += held
                res = Reservation(request_id, d - span, d, reload_bytes, per_iteration, held)
                self.reservations[request_id] = res
                return res
        return None

    def admit(
        self,
        request_id: str,
        reload_bytes: int,
        anchor_gap: int,
        device_bytes: int | None = None,
        not_before: int | None = None,
    ) -> dict[str, Reservation]:
        """Queue a request for a verification about ``anchor_gap`` iterations ahead, its reload
        moving ``reload_bytes`` over the link and holding ``device_bytes`` (default: as many) on
        the device, then admit what fits, oldest first: returns every reservation made now (the
        new request's among them if it fit, and those of requests that were waiting before it).
        ``not_before`` is the earliest iteration (absolute) the verification may run, for an engine
        whose requests cannot verify before their drafts are done."""
        if request_id in self.reservations:
            raise ValueError(f"request {request_id} already has a reservation")
        device_bytes = reload_bytes if device_bytes is None else device_bytes
        if reload_bytes <= 0 or device_bytes < 0:
            raise ValueError(
                f"request {request_id}: a reload of {reload_bytes} link bytes and {device_bytes} "
                "device bytes (link bytes must be > 0, device bytes >= 0)"
            )
        earliest = self.now if not_before is None else not_before
        self.waiting.append((request_id, reload_bytes, device_bytes, anchor_gap, earliest))
        return self.retry_waiting()

    def retry_waiting(self) -> dict[str, Reservation]:
        """Admit what now fits from the waiting queue, oldest first (stopping at the first that
        does not fit, so a later small request cannot overtake an earlier large one forever)."""
        admitted = {}
        while self.waiting:
            request_id, nbytes, device_bytes, gap, earliest = self.waiting[0]
            res = self._try(request_id, nbytes, device_bytes, gap, earliest)
            if res is None:
                break
            self.waiting.popleft()
            admitted[request_id] = res
        return admitted

    def cancel(self, request_id: str) -> None:
        """Drop a request's reservation (it finished or left) and any place in the queue."""
        res = self.reservations.pop(request_id, None)
        self.waiting = deque(w for w in self.waiting if w[0] != request_id)
        if res is None:
            return
        for i in range(max(res.reload_start, self.now), res.verify_at):
            self.link[i % self.window] -= res.link_s_per_iteration
        for i in range(max(res.reload_start, self.now), res.verify_at + 1):
            self.memory[i % self.window] -= res.device_bytes

    def complete(self, request_id: str) -> None:
        """The request verified this iteration: its reservation is consumed."""
        self.reservations.pop(request_id, None)

    # the clock
    def reloads_starting(self) -> list[Reservation]:
        return [r for r in self.reservations.values() if r.reload_start == self.now]

    def verifying(self) -> list[Reservation]:
        return [r for r in self.reservations.values() if r.verify_at == self.now]

    def tick(self) -> None:
        """End the current iteration: free its ring slot for the window's new last iteration."""
        slot = self.now % self.window
        self.link[slot] = 0.0
        self.memory[slot] = 0
        self.now += 1

    def check(self) -> None:
        """Invariants: the rings never over-commit the link or the memory (for tests)."""
        for i in range(self.window):
            assert self.link[i] <= self.iteration_s + 1e-6, (i, self.link[i], self.iteration_s)
            assert self.memory[i] <= self.memory_capacity, (i, self.memory[i], self.memory_capacity)
