"""When each offloaded request's full KV comes back to the device: the core's staggered scheduler
over a tier (the host pool or the store) and a device allocator.

Every decision is the core's ``StaggeredScheduler`` (link and memory rings, measured link and
iteration times); this module carries it out on SGLang's objects: at the iteration a reservation's
reload starts, device slots are taken from ``allocator`` and the tier loads the request's full KV
into them per layer; at its verify iteration the caller gets the slots and the producer to wait
on; after the verify pass, ``verified`` gives the slots back. Device slots for reloads exist only
between a reload's start and its verification, so the device holds the full KV of the requests
verifying soon, not of every running request.

Runs inside real SGLang servers on CPU (``full_kv`` "host" and "store",
tests/sglang/test_sglang_e2e_modes.py) and on SGLang's pools in unit tests; on a GPU, where a
reload overlaps the verify pass, unverified.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from vericache_sglang.core.schedule import Reservation, StaggeredScheduler

if TYPE_CHECKING:
    from sglang.srt.mem_cache.allocator.base import BaseTokenToKVPoolAllocator

    from vericache_sglang.sglang.full_kv.host_tier import HostFullKV
    from vericache_sglang.sglang.full_kv.offload_rows import SlotArena
    from vericache_sglang.sglang.full_kv.store_tier import StoreFullKV


class ReloadRoomExhausted(RuntimeError):
    """The allocator has fewer free slots than a planned reload needs (the budget given to the
    scheduler is larger than what the allocator really has)."""


@dataclass
class Reload:
    rid: str
    slots: torch.Tensor  # device slots holding the request's full KV, in token order
    producer: int  # the host tier's layer-counter producer to wait on
    reservation: Reservation


class StaggeredReloads:
    def __init__(
        self,
        tier: HostFullKV | StoreFullKV,
        scheduler: StaggeredScheduler,
        allocator: SlotArena | BaseTokenToKVPoolAllocator,
    ):
        self.tier = tier
        self.scheduler = scheduler
        self.allocator = allocator
        self.inflight: dict[str, Reload] = {}

    def admit(self, rid: str, anchor_gap: int, not_before: int | None = None) -> dict[str, Reservation]:
        """Plan ``rid``'s next verification about ``anchor_gap`` iterations ahead (its reload moves
        and holds the full KV the host tier has for it)."""
        nbytes = self.tier.nbytes(rid)
        return self.scheduler.admit(rid, nbytes, anchor_gap, device_bytes=nbytes, not_before=not_before)

    def start_due(self) -> list[Reload]:
        """Start every reload whose reservation begins by this iteration (one H2D submission); a
        reservation made after this iteration's call starts at the next."""
        now = self.scheduler.now
        due = [
            r
            for r in self.scheduler.reservations.values()
            if r.reload_start <= now and r.request_id not in self.inflight
        ]
        if not due:
            return []
        taken: list[tuple[Reservation, torch.Tensor]] = []
        for res in due:
            n = self.tier.num_tokens(res.request_id)
            slots = self.allocator.alloc(n)
            if slots is None:
                for _, s in taken:
                    self.allocator.free(s)
                raise ReloadRoomExhausted(
                    f"request {res.request_id}: {n} device slots for its reload, "
                    f"the allocator has {self.allocator.available_size()}"
                )
            taken.append((res, slots))
        producer = self.tier.reload([(res.request_id, slots) for res, slots in taken])
        started = [Reload(res.request_id, slots, producer, res) for res, slots in taken]
        self.inflight.update((r.rid, r) for r in started)
        return started

    def verifying(self) -> list[Reload]:
        """The reloads whose verification runs this iteration (their producers to ``consume``)."""
        return [self.inflight[r.request_id] for r in self.scheduler.verifying() if r.request_id in self.inflight]

    def before_verify(self, group: list[Reload]) -> None:
        """Make the verify pass of ``group`` wait for its reloads: per layer on the newest (which
        may still be loading as the pass starts), whole on older ones (done or nearly)."""
        newest = max(group, key=lambda r: r.reservation.reload_start).producer
        for producer in {r.producer for r in group} - {newest}:
            self.tier.wait_loaded(producer)
        self.tier.consume(newest)

    def after_verify(self, group: list[Reload]) -> None:
        """The verify pass of ``group`` is issued: later passes stop waiting, and each request's
        slots go back (``verified``)."""
        self.tier.done()
        for reload in group:
            self.verified(reload.rid)

    def verified(self, rid: str) -> None:
        """``rid``'s verify pass ran: its device slots go back, its reservation is consumed, and
        the link time its reload took (where the device times it) feeds the scheduler."""
        reload = self.inflight.pop(rid)
        self.allocator.free(reload.slots)
        self.scheduler.complete(rid)
        sample = self.tier.link_sample(reload.producer)
        if sample is not None:
            self.scheduler.observe_link(*sample)

    def cancel(self, rid: str) -> None:
        """``rid`` left (finished or aborted): drop its plan and any device slots it holds."""
        reload = self.inflight.pop(rid, None)
        if reload is not None:
            self.tier.wait_loaded(reload.producer)  # nothing may still be writing into the slots
            self.allocator.free(reload.slots)
        self.scheduler.cancel(rid)

    def end_iteration(self, seconds: float) -> None:
        self.scheduler.observe_iteration(seconds)
        self.scheduler.tick()

    def observe_link(self, nbytes: int, seconds: float) -> None:
        self.scheduler.observe_link(nbytes, seconds)

    def device_tokens(self) -> int:
        """Device slots held by reloads now."""
        return sum(int(r.slots.numel()) for r in self.inflight.values())
