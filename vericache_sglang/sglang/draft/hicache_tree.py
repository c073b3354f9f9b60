"""The ``vericache`` radix-cache backend with HiCache on (``--enable-hierarchical-cache``): SGLang's
own HiCache tree (``UnifiedRadixCache``: device, host pool, L3 storage, prefetch, write-through),
plus VeriCache's compressed copies of cached prefixes.

With HiCache the full KV of a cached prefix moves between SGLang's tiers on its own terms: written
through to the host pool and the L3 store, evicted from the device and loaded back (or prefetched
from the store, on this server or another) before the request that matches it is prefilled. The
compressed copy a request drafts from stays here, next to the tree, keyed by its content (the
token prefix and the request's cache namespace) rather than by a tree node: its node may leave the
device, and another server's may arrive from the store. A copy is a pure function of its prefix
(drafting only proposes; verification over the full KV decides every token), so a copy found by
content is valid wherever the tree's full KV of that prefix comes from. Copies are kept
least-recently-used, at most ``MAX_COPIES``.

The cached prefixes' full KV is HiCache's to move. A running request's own full KV is not: HiCache
never moves it, so with ``full_kv`` "store" or "host" the worker's tier does (its prefix loads off:
this tree's L3 prefetch loads prefixes; its loads waited for whole, HiCache's controller owning the
pool's layer counter), and the request's rows are freed around its offloaded positions
(``OffloadedRows``). Such a request is barred from the tree, so its prompt is inserted right after
prefill (``FullKVOffload.admit``: SGLang's ``checkpoint``), for HiCache to write through to its
host pool and L3 store, where other servers find it. With "store" the prompt then leaves the
device with the request (the store tier writes or adopts its records): the request unlocks its
tree node, which HiCache may evict to its host pool. With "host" it stays pinned, as a matched
prefix does.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

from vericache_sglang.sglang.draft.radix_cache import CompressedPrefix, OffloadedRows, register_tree
from vericache_sglang.sglang.step.draft_state import OBS_WINDOW

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req

MAX_COPIES = 64


def prefix_digests(req: Req, lengths: Sequence[int]) -> list[bytes]:
    """One digest per length in ``lengths`` (ascending) of ``req``'s prompt cut there, in its
    cache namespace (adapter key, salt): one pass over the tokens."""
    h = hashlib.blake2b(digest_size=16)
    h.update(repr((req.extra_key, req.cache_salt)).encode())
    tokens = req.origin_input_ids
    out, done = [], 0
    for length in lengths:
        h.update(b"".join(int(t).to_bytes(4, "little") for t in tokens[done:length]))
        done = length
        out.append(h.copy().digest())
    return out


class PrefixCopies:
    """Compressed copies by content (a prompt prefix's digest), least recently used first out
    beyond ``max_copies``."""

    def __init__(self, max_copies: int = MAX_COPIES):
        self.max_copies = max_copies
        self._copies: OrderedDict[bytes, CompressedPrefix] = OrderedDict()
        self.nbytes = 0
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._copies)

    def longest(self, req: Req, cached: int, grain: int) -> CompressedPrefix | None:
        """The copy of the longest prefix of ``req``'s prompt, at most ``cached`` tokens and a
        multiple of ``grain``, that has one."""
        lengths = list(range(grain, cached + 1, grain))
        for length, digest in reversed(list(zip(lengths, prefix_digests(req, lengths), strict=True))):
            copy = self._copies.get(digest)
            if copy is not None and copy.num_tokens == length:
                self._copies.move_to_end(digest)
                return copy
        return None

    def keep(self, req: Req, copy: CompressedPrefix) -> None:
        """Keep ``copy``, the compressed KV of ``req``'s first ``copy.num_tokens`` prompt tokens."""
        (digest,) = prefix_digests(req, [copy.num_tokens])
        old = self._copies.pop(digest, None)
        if old is not None:
            self.nbytes -= old.nbytes
        self._copies[digest] = copy
        self.nbytes += copy.nbytes
        while len(self._copies) > self.max_copies:
            _, dropped = self._copies.popitem(last=False)
            self.nbytes -= dropped.nbytes
            self.evicted += 1


class VeriCacheHiRadixCache(OffloadedRows, UnifiedRadixCache):
    def reset(self) -> None:
        super().reset()
        self.copies = PrefixCopies()
        # called with a request's id when SGLang releases its row (finish, abort, retraction)
        self.release_listeners: list[Callable[[str], None]] = getattr(self, "release_listeners", [])
        register_tree(self)

    def swa_reprefill_tail_tokens(self, req: Req | None = None) -> int:
        """The worker's observation window is computed again even when cached (``radix_cache``)."""
        return max(OBS_WINDOW, super().swa_reprefill_tail_tokens(req))

    # -- compressed copies (the worker's interface, as VeriCacheRadixCache's) -------------------

    def copy_for(self, req: Req, cached: int, grain: int) -> CompressedPrefix | None:
        return self.copies.longest(req, cached, grain)

    def keep_copy(self, req: Req, copy: CompressedPrefix) -> None:
        self.copies.keep(req, copy)

    def copy_count(self) -> int:
        return len(self.copies)
