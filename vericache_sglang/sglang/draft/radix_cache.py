"""The ``vericache`` radix-cache backend: SGLang's radix tree, plus a compressed-KV copy of each
cached prefix that VeriCache drafts from, kept next to the tree and evicted with it.

A copy belongs to the node that ends its prefix and covers every token from the root to that
node's end (a compressor scores a prefix as a whole, so a copy cannot be cut per segment). When a
lookup splits a node, the copy stays with the deeper half, whose path is unchanged. A copy is
dropped the moment its node leaves the tree, so a lookup can only ever return the copy of a
prefix that is still cached.

Matching leaves the prompt's last ``OBS_WINDOW`` tokens to be computed again (SGLang's
``swa_reprefill_tail_tokens`` extension point): the worker scores a prompt by its last queries
(SnapKV's observation window), which a cached prefix does not keep. A request whose prompt
continues a cached prefix drafts over the deepest copy on its matched path, with its own tokens
after it folded in exactly; the first request without one makes it, for the matched prefix cut
down to a multiple of ``COPY_GRAIN`` tokens (so requests whose questions differ in length still
meet at the same node), scored by that request's queries, which follow the prefix.

Requests whose full KV the worker offloads (``full_kv`` "store" or "host") stay out of the tree;
their rows are freed through ``free_kv_row``/``on_release``, which leave the offloaded positions
alone. With ``"store"`` their prompts' whole chunks are in the store, and ``match_prefix`` loads a
stored prefix back into the tree for the next request over it, on this server or another.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from sglang.srt.mem_cache.base_prefix_cache import (
    EvictParams,
    EvictResult,
    InsertParams,
    MatchPrefixParams,
    MatchResult,
)
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey, TreeNode

from vericache_sglang.core.kv import CompressedKV
from vericache_sglang.sglang.full_kv.layer_loads import LayerLoads, PrefixLoad
from vericache_sglang.sglang.full_kv.offload_rows import offload_for
from vericache_sglang.sglang.full_kv.store_tier import StoreFullKV
from vericache_sglang.sglang.step.draft_state import OBS_WINDOW

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req, ReqKvInfo
    from sglang.srt.mem_cache.allocator.base import BaseTokenToKVPoolAllocator
    from sglang.srt.mem_cache.base_prefix_cache import BasePrefixCache, InsertResult
    from sglang.srt.mem_cache.registry import TreeCacheBuildContext

_TREES: weakref.WeakValueDictionary[int, BasePrefixCache] = weakref.WeakValueDictionary()


def register_tree(tree: BasePrefixCache) -> None:
    """Make ``tree`` (a vericache radix cache, or the HiCache one) the worker's way to its pool."""
    if tree.token_to_kv_pool_allocator is not None:
        _TREES[id(tree.token_to_kv_pool_allocator)] = tree


def tree_for(allocator: BaseTokenToKVPoolAllocator) -> VeriCacheRadixCache | None:
    """The vericache radix cache over the pool ``allocator`` serves (the worker's way to it)."""
    tree = _TREES.get(id(allocator))
    return tree if tree is not None and tree.token_to_kv_pool_allocator is allocator else None


@dataclass(frozen=True)
class CompressedPrefix:
    """A cached prefix's compressed KV: drafting state for every request that shares it."""

    num_tokens: int  # prefix length (tokens from the root), not tokens kept
    kv: CompressedKV

    @property
    def nbytes(self) -> int:
        return self.kv.nbytes


class OffloadedRows:
    """Both vericache trees (this one and HiCache's, ``hicache_tree``): rows of requests whose full
    KV the worker offloads (``full_kv`` "store" or "host", ``offload.py``) are freed through
    ``free_kv_row``/``on_release``, which leave the offloaded positions alone (they hold the pool's
    padding slot, not slots of their own) and drop the tier's copy with the request."""

    token_to_kv_pool_allocator: BaseTokenToKVPoolAllocator
    release_listeners: list[Callable[[str], None]]

    def free_kv_row(self, kv: ReqKvInfo, ranges: list[tuple[int, int]]) -> None:
        ledger = offload_for(self.token_to_kv_pool_allocator)
        if ledger is not None:
            ranges = ledger.resident_ranges(kv.req_pool_idx, ranges)
        if ranges:
            super().free_kv_row(kv, ranges)

    def on_release(self, req: Req, *, checkpointed: bool) -> None:
        super().on_release(req, checkpointed=checkpointed)
        ledger = offload_for(self.token_to_kv_pool_allocator)
        if ledger is not None:
            ledger.release(req.rid)
        for listener in self.release_listeners:
            listener(req.rid)


class VeriCacheRadixCache(OffloadedRows, RadixCache):
    def reset(self) -> None:
        super().reset()
        self._copies: dict[int, tuple[TreeNode, CompressedPrefix]] = {}  # by node id
        self.compressed_bytes = 0
        self.copies_evicted = 0
        # called with a request's id when SGLang releases its row (finish, abort, retraction)
        self.release_listeners: list[Callable[[str], None]] = getattr(self, "release_listeners", [])
        register_tree(self)

    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        """SGLang's match; with ``full_kv: "store"``, a scheduled request's prompt is also looked
        up in the store: a longer prefix any server (or an earlier request) wrote there is loaded
        into device slots and inserted into the tree, so SGLang reports it cached and prefills only
        the rest. The store's records are checked; a miss or a bad record is an ordinary miss."""
        result = super().match_prefix(params)
        key = params.key
        if params.req is None or self.disable or key.extra_key is not None or key.cache_salt is not None:
            return result  # the tree's own lookups, and requests kept apart from others (salt, adapter)
        ledger = offload_for(self.token_to_kv_pool_allocator)
        source = getattr(ledger, "tier", None)
        if not isinstance(source, StoreFullKV):
            return result
        have = result.device_prefix_len
        tokens = list(key.token_ids[: len(key)])
        n = source.stored_prefix(tokens, have)
        if n <= have:
            return result
        alloc = self.token_to_kv_pool_allocator
        if alloc.available_size() < n - have:
            self.evict(EvictParams(num_tokens=n - have))
        slots = alloc.alloc(n - have)
        if slots is None:
            return result
        # promised now, loaded behind: the prefill pass waits per layer (full_kv/layer_loads.py)
        source.start_prefix_load(tokens[:n], have, slots)
        value = torch.cat([self.path_device_indices(result.last_device_node).to(slots.device), slots.to(torch.int64)])
        self.insert(InsertParams(key=RadixKey(key.token_ids[:n]), value=value))  # the tree's own id type
        return super().match_prefix(params)

    def evict(self, params: EvictParams) -> EvictResult:
        """SGLang's eviction, once no load is still writing into slots it could free."""
        loads = self._layer_loads()
        if loads is not None and loads.pending():
            loads.settle()
        return super().evict(params)

    def drop(self, load: PrefixLoad) -> bool:
        """Take a failed load's positions out of the tree (no pass read them): every node from the
        one holding its first position down, freed. False while a request holds one (locked)."""
        node, depth = self.root_node, 0
        while depth < load.have:  # the node the load's first position starts (a split may have moved it)
            child = node.children.get(RadixKey(load.tokens[depth:]).child_key(self.page_size))
            if child is None:
                return True  # gone already (evicted)
            node, depth = child, depth + len(child.key)
        if depth != load.have:
            return True  # not where the load put it: evicted and written again since
        child = node.children.get(RadixKey(load.tokens[depth:]).child_key(self.page_size))
        if child is None:
            return True
        subtree = [child]
        for n in subtree:
            subtree.extend(n.children.values())
        if any(n.lock_ref > 0 for n in subtree):
            return False
        for n in reversed(subtree):  # leaves first
            self.token_to_kv_pool_allocator.free_segment(n.value, start_pos=0)
            self._delete_leaf(n)
            self.kv_events.record_remove(n)
        return True

    def _layer_loads(self) -> LayerLoads | None:
        source = getattr(offload_for(self.token_to_kv_pool_allocator), "tier", None)
        return source.layer_loads if isinstance(source, StoreFullKV) else None

    def swa_reprefill_tail_tokens(self, req: Req | None = None) -> int:
        """Tokens at the end of a prompt that are computed again even when cached: the worker's
        observation window (the prompt's last queries, which the tree does not keep)."""
        return OBS_WINDOW

    # -- compressed copies ------------------------------------------------------------------

    def insert_with_copy(self, key: RadixKey, value: torch.Tensor, kv: CompressedKV) -> InsertResult:
        """Insert a prefix (SGLang's insert) and attach its compressed copy to the node ending it."""
        result = self.insert(InsertParams(key=key, value=value))
        node = result.last_device_node
        length = self._path_len(node)
        if length != len(key.page_aligned(self.page_size)):
            raise ValueError(f"inserted prefix ends at {length} tokens, key has {len(key)}")
        self.attach_copy(node, CompressedPrefix(length, kv))
        return result

    def attach_copy(self, node: TreeNode, copy: CompressedPrefix) -> None:
        if node is self.root_node or node.parent is None or self._path_len(node) != copy.num_tokens:
            raise ValueError("a compressed copy must be attached to the node ending its prefix")
        old = self._copies.get(node.id)
        if old is not None:
            self.compressed_bytes -= old[1].nbytes
        self._copies[node.id] = (node, copy)
        self.compressed_bytes += copy.nbytes

    def match_with_copy(self, key: RadixKey) -> tuple[MatchResult, CompressedPrefix | None]:
        """SGLang's prefix match, and the compressed copy of the longest matched prefix that has one."""
        result = self.match_prefix(MatchPrefixParams(key=key))
        node = result.last_device_node
        while node is not None and node is not self.root_node:
            entry = self._copies.get(node.id)
            if entry is not None and entry[0] is node:
                return result, entry[1]
            node = node.parent
        return result, None

    def copy_for(self, req: Req, cached: int, grain: int) -> CompressedPrefix | None:
        """The copy of the longest prefix on the path of ``req``'s matched node (``cached`` tokens)
        that has one (the worker keeps copies at multiples of ``grain``; the walk finds them)."""
        node = getattr(req, "last_node", None)
        if node is None or self._path_len(node) != cached:
            return None
        return self.nearest_copy(node)

    def keep_copy(self, req: Req, copy: CompressedPrefix) -> None:
        """Attach ``copy``, the compressed KV of ``req``'s first ``copy.num_tokens`` prompt tokens."""
        self.attach_copy(self.node_at(req, copy.num_tokens), copy)

    def copy_at(self, node: TreeNode) -> CompressedPrefix | None:
        """The copy attached to ``node`` itself (not to an ancestor)."""
        entry = self._copies.get(node.id)
        return entry[1] if entry is not None and entry[0] is node else None

    def nearest_copy(self, node: TreeNode) -> CompressedPrefix | None:
        """The copy of the longest prefix on ``node``'s path from the root that has one."""
        while node is not None and node is not self.root_node:
            copy = self.copy_at(node)
            if copy is not None:
                return copy
            node = node.parent
        return None

    def node_at(self, req: Req, length: int) -> TreeNode:
        """The node ending exactly ``length`` tokens into ``req``'s cached prompt (SGLang's match
        splits a node there if needed); ``length`` must not exceed what is cached."""
        key = RadixKey(token_ids=req.origin_input_ids, extra_key=req.extra_key, limit=length, cache_salt=req.cache_salt)
        node = self.match_prefix(MatchPrefixParams(key=key)).last_device_node
        if self._path_len(node) != length:
            raise ValueError(f"the tree holds {self._path_len(node)} tokens of this prompt, not {length}")
        return node

    def path_len(self, node: TreeNode) -> int:
        """Tokens from the root to the end of ``node``."""
        return self._path_len(node)

    def copy_count(self) -> int:
        return len(self._copies)

    # -- keeping copies and tree together ------------------------------------------------------

    def _delete_leaf(self, node: TreeNode) -> None:
        super()._delete_leaf(node)
        entry = self._copies.pop(node.id, None)
        if entry is not None:
            self.compressed_bytes -= entry[1].nbytes
            self.copies_evicted += 1

    def _path_len(self, node: TreeNode) -> int:
        n = 0
        while node is not None and node is not self.root_node:
            n += len(node.key)
            node = node.parent
        return n


def create_radix_cache(ctx: TreeCacheBuildContext) -> BasePrefixCache:
    """Factory registered as ``vericache`` in SGLang's radix-cache registry; with HiCache on,
    SGLang's own HiCache tree carrying the copies (``hicache_tree``)."""
    if ctx.is_hybrid_swa or ctx.is_hybrid_ssm or getattr(ctx, "is_dsa", False):
        raise ValueError("the vericache radix cache serves full-attention models only")
    if ctx.enable_hierarchical_cache:
        from sglang.srt.mem_cache.registry import create_unified_radix_cache

        from vericache_sglang.sglang.draft.hicache_tree import VeriCacheHiRadixCache

        return create_unified_radix_cache(ctx, cache_class=VeriCacheHiRadixCache)
    return VeriCacheRadixCache(ctx.params)
