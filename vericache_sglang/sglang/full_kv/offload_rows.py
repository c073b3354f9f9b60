"""Which row positions of each running request hold their KV in a tier (the host pool, the store)
instead of device slots, and the reload arena verifications borrow device slots from.

SGLang keeps one ``req_to_token`` row per request, and its scheduler and radix tree free slots by
reading that row. An offloaded request is barred from the radix tree (``skip_radix_cache_insert``),
so every position from its ``cache_protected_len`` (the end of the prefix it matched, which the
tree owns) is its own; with the store tier the matched prefix is taken too (``take_prefix``: the
store holds it, the request is unpinned from the tree) and its positions start at 0.
``RequestOffload.offload_through`` moves positions ``[start, end)`` to the tier, frees their
device slots and writes the pool's padding slot in their place: a stray read there returns
padding, never another request's KV, and SGLang's allocators never hand the padding slot out.
For a verification the caller reloads those positions into slots from a ``SlotArena`` and
``lend``s them to the row, so the stock verify pass reads the row as usual; ``unlend`` puts the
padding back. When SGLang frees a finishing or retracted request's row, it goes through the tree
cache's ``free_kv_row``; the vericache radix cache narrows the ranges with ``resident_ranges``,
so what was offloaded is never freed twice.

The ledger is found from the tree cache by the allocator both share (``offload_for``): SGLang
builds the worker's pools before the tree cache and hands neither a reference to the other.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # the radix cache imports this module at plugin registration: keep it light
    from sglang.srt.mem_cache.allocator.base import BaseTokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    from vericache_sglang.sglang.full_kv.host_tier import HostFullKV
    from vericache_sglang.sglang.full_kv.store_tier import StoreFullKV

PAD_SLOT = 0  # SGLang's pools reserve slot 0 for padding; allocators start at 1


class SlotArena:
    """Device slots taken once from the scheduler's allocator and lent to reloads: the reload room
    the scheduler's admission never sees, so a planned reload always finds its slots."""

    def __init__(self, allocator: BaseTokenToKVPoolAllocator, num_slots: int):
        if num_slots <= 0:
            raise ValueError(f"the reload arena needs > 0 slots, got {num_slots}")
        slots = allocator.alloc(num_slots)
        if slots is None:
            raise ValueError(
                f"the KV pool has {allocator.available_size()} free slots, the reload arena asks for {num_slots}"
            )
        self.owner = allocator
        self.size = num_slots
        self._free = slots.to(torch.int64)

    def available_size(self) -> int:
        return int(self._free.numel())

    def alloc(self, n: int) -> torch.Tensor | None:
        if n > self._free.numel():
            return None
        taken, self._free = self._free[:n], self._free[n:]
        return taken

    def free(self, slots: torch.Tensor) -> None:
        self._free = torch.cat([self._free, slots.to(self._free.device, torch.int64)])

    def close(self) -> None:
        """Give every slot back to the scheduler's allocator (all loans must be returned)."""
        if self._free.numel() != self.size:
            raise RuntimeError(f"{self.size - self._free.numel()} arena slots are still lent")
        self.owner.free(self._free)
        self._free = self._free[:0]


@dataclass
class _Record:
    rid: str
    row: int  # req_to_token row (req_pool_idx)
    start: int  # [start, end): positions whose KV is in the tier
    end: int
    lent: torch.Tensor | None = None  # arena slots written over [start, end) for a verification


class RequestOffload:
    def __init__(
        self, tier: HostFullKV | StoreFullKV, req_to_token_pool: ReqToTokenPool, allocator: BaseTokenToKVPoolAllocator
    ):
        self.tier = tier
        self.req_to_token = req_to_token_pool.req_to_token
        self.allocator = allocator
        self._by_rid: dict[str, _Record] = {}
        self._by_row: dict[int, _Record] = {}
        self.on_release: list[Callable[[str], None]] = []  # called with the rid once its row is freed

    def offload_through(self, rid: str, row: int, start: int, end: int) -> int:
        """Move ``rid``'s positions up to ``end`` (from ``start``, its first own position, on its first
        call) to the tier and free their device slots; returns the tokens moved now."""
        rec = self._by_rid.get(rid)
        if rec is None:
            if row in self._by_row:
                raise ValueError(f"row {row} is already offloaded for request {self._by_row[row].rid}")
            rec = _Record(rid, row, start, start)
        elif rec.row != row or rec.start != start:
            raise ValueError(f"request {rid} moved: row {rec.row} from {rec.start} before, row {row} from {start} now")
        if rec.lent is not None:
            raise RuntimeError(f"request {rid} holds lent slots (a verification has not returned them)")
        if end <= rec.end:
            return 0
        positions = self.req_to_token[row, rec.end : end]
        slots = positions.to(torch.int64).clone()
        if bool((slots == PAD_SLOT).any()):
            raise ValueError(f"request {rid}: positions [{rec.end}, {end}) include unallocated slots")
        self.tier.wait_offloaded(self.tier.offload(rid, slots))
        self.allocator.free(slots)
        positions.fill_(PAD_SLOT)
        if rec.rid not in self._by_rid:
            self._by_rid[rid] = self._by_row[row] = rec
        moved, rec.end = end - rec.end, end
        return moved

    def take_prefix(self, rid: str, row: int, end: int) -> None:
        """``rid``'s first ``end`` positions, the prefix it matched in the radix tree, are in the tier
        already: they count as offloaded from now on (fetched for each verification) and the row
        stops pointing at the tree's slots, which are not freed (the tree keeps them as a cache)."""
        if rid in self._by_rid or row in self._by_row:
            raise ValueError(f"request {rid} (row {row}) already has offloaded positions")
        if end <= 0:
            raise ValueError(f"request {rid}: no prefix to take ({end} positions)")
        self.req_to_token[row, :end] = PAD_SLOT
        self._by_rid[rid] = self._by_row[row] = _Record(rid, row, 0, end)

    def held(self, rid: str) -> tuple[int, int] | None:
        """``(start, end)`` of ``rid``'s positions in the tier, or None."""
        rec = self._by_rid.get(rid)
        return None if rec is None else (rec.start, rec.end)

    def lend(self, rid: str, slots: torch.Tensor) -> None:
        """Point ``rid``'s offloaded positions at ``slots`` (its full KV reloaded there)."""
        rec = self._by_rid[rid]
        if rec.lent is not None:
            raise RuntimeError(f"request {rid} already holds lent slots")
        if slots.numel() != rec.end - rec.start:
            raise ValueError(f"request {rid}: {slots.numel()} slots for {rec.end - rec.start} offloaded positions")
        self.req_to_token[rec.row, rec.start : rec.end] = slots.to(self.req_to_token.dtype)
        rec.lent = slots

    def unlend(self, rid: str) -> torch.Tensor:
        """Put the padding back over ``rid``'s offloaded positions; returns the slots it held."""
        rec = self._by_rid[rid]
        if rec.lent is None:
            raise RuntimeError(f"request {rid} holds no lent slots")
        self.req_to_token[rec.row, rec.start : rec.end] = PAD_SLOT
        slots, rec.lent = rec.lent, None
        return slots

    def resident_ranges(self, row: int, ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """``ranges`` of ``row`` without its offloaded (or lent) positions: what still has slots of
        the row's own."""
        rec = self._by_row.get(row)
        if rec is None or rec.end == rec.start:
            return ranges
        out = []
        for lo, hi in ranges:
            for a, b in ((lo, min(hi, rec.start)), (max(lo, rec.end), hi)):
                if a < b:
                    out.append((a, b))
        return out

    def release(self, rid: str) -> None:
        """Forget ``rid`` (SGLang is freeing its row) and drop its KV in the tier. Slots lent to it stay
        the arena's: whoever planned its reload gives them back (``on_release`` listeners)."""
        rec = self._by_rid.pop(rid, None)
        if rec is None:
            return
        del self._by_row[rec.row]
        if rec.lent is not None:
            self.req_to_token[rec.row, rec.start : rec.end] = PAD_SLOT
        self.tier.release(rid)
        for listener in self.on_release:
            listener(rid)

    def __contains__(self, rid: str) -> bool:
        return rid in self._by_rid

    def __len__(self) -> int:
        return len(self._by_rid)


_LEDGERS: weakref.WeakValueDictionary[int, RequestOffload] = weakref.WeakValueDictionary()


def register_offload(allocator: BaseTokenToKVPoolAllocator, ledger: RequestOffload) -> None:
    _LEDGERS[id(allocator)] = ledger


def offload_for(allocator: BaseTokenToKVPoolAllocator) -> RequestOffload | None:
    """The ledger of the worker whose pool ``allocator`` serves, if it offloads."""
    ledger = _LEDGERS.get(id(allocator))
    return ledger if ledger is not None and ledger.allocator is allocator else None
