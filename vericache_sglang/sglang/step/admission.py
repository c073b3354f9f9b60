"""A prefilled prompt's admission to drafting: its exact KV read out of SGLang's pool, compressed
into the request's private draft row.

A prompt that continues a cached prefix (matched in the radix tree, then computed in one extend)
drafts over the deepest compressed copy on its matched path (``draft.radix_cache``), made now if
there is none, with the prompt's own tokens after it folded in exactly: a shared document is
compressed once, not once per question.

A compressor that asks the model for more than the observation window (KVzip's reconstruction)
gets a ``PoolProbe`` over the request's row (``probe.py``); when the pool has no room for its
probe the request has no draft row and is verified one token a step, as when the draft pool is full.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from vericache_sglang.core.compress import Compressor, Observation
from vericache_sglang.core.kv import CompressedKV, FullKV, KVLayout
from vericache_sglang.sglang.draft.pool import CompressedDraftPool, DraftPoolFull
from vericache_sglang.sglang.draft.radix_cache import CompressedPrefix, VeriCacheRadixCache, tree_for
from vericache_sglang.sglang.pool_kv import read_full_kv
from vericache_sglang.sglang.step.draft_state import QueryCapture
from vericache_sglang.sglang.step.probe import PoolProbe, ProbeUnavailable

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
    from sglang.srt.model_executor.model_runner import ModelRunner

    from vericache_sglang.sglang.draft.hicache_tree import VeriCacheHiRadixCache

logger = logging.getLogger(__name__)
MIN_SHARED_PREFIX = 256  # a cached prefix shorter than this is compressed with the prompt, not shared
COPY_GRAIN = 256  # compressed copies end at multiples of this many tokens


class PromptAdmission:
    """Admits prefilled prompts into ``draft_pool``; ``on_release(rid)`` hears of rows the radix tree
    releases (a retracted or aborted request's draft row goes with its KV row); ``count(name)``
    counts prefix-copy hits and copies made; ``probe(batch, req, tokens)`` builds the probe source
    over ``req``'s first ``len(tokens)`` tokens, for compressors that need one."""

    def __init__(
        self,
        runner: ModelRunner,
        layout: KVLayout,
        compressor: Compressor,
        draft_pool: CompressedDraftPool,
        capture: QueryCapture,
        on_release: Callable[[str], None],
        count: Callable[[str], None],
        probe: Callable[[ScheduleBatch, Req, list[int]], PoolProbe] | None = None,
    ):
        self.runner = runner
        self.layout = layout
        self.compressor = compressor
        self.draft_pool = draft_pool
        self.capture = capture
        self.on_release = on_release
        self.count = count
        self.probe = probe  # None unless the compressor needs one (``probe.pool_probes``)

    def admit(self, batch: ScheduleBatch, req: Req, seq_len: int, ext: int) -> FullKV:
        """Compress a prompt whose KV is complete into the request's draft row; returns its full KV."""
        slots = self.runner.req_to_token_pool.req_to_token[req.kv.req_pool_idx, :seq_len].to(torch.int64)
        full = read_full_kv(self.runner.token_to_kv_pool, slots, self.layout)
        try:
            kv = self._compressed(batch, req, seq_len, ext, full)
        except ProbeUnavailable as e:
            self.capture.forget(req.rid)
            logger.warning("VeriCache: request %s has no draft row (%s); verified one token per step", req.rid, e)
            return full
        try:
            self.draft_pool.admit(req.rid, kv, seq_len)
        except DraftPoolFull as e:
            logger.warning("VeriCache: request %s has no draft row (%s); verified one token per step", req.rid, e)
        return full

    def _compressed(self, batch: ScheduleBatch, req: Req, seq_len: int, ext: int, full: FullKV) -> CompressedKV:
        # the prefix the tree holds: a chunked prefill's earlier chunks are the request's own when
        # it offloads (barred from the tree), not a cached prefix
        copy = self._prefix_copy(batch, req, min(seq_len - ext, int(req.kv.cache_protected_len)), full)
        if copy is None:
            kv = self.compressor.compress(full, self._observation(batch, req, seq_len))
        else:
            kv = copy.kv.clone()
            # the prompt's own tokens folded in exactly; with +refresh the copy's rows stay the
            # document's until the first verification re-chooses them (as the reference engine)
            positions = torch.arange(copy.num_tokens, seq_len, device=self.runner.device)
            for layer, (k, v) in enumerate(full.slice(copy.num_tokens, seq_len).layers):
                self.compressor.update(kv, layer, k, v, positions)
        return kv

    def _observation(self, batch: ScheduleBatch, req: Req, n: int, follows: bool = False) -> Observation:
        """The request's prefill queries, and for a probing compressor the model over its first ``n`` tokens."""
        obs = self.capture.observation(req.rid, follows=follows)
        if self.probe is not None:
            obs.source = self.probe(batch, req, [*req.origin_input_ids, *req.output_ids][:n])
        return obs

    def tree(self) -> VeriCacheRadixCache | VeriCacheHiRadixCache | None:
        """The vericache radix cache (built after the worker's pools; SGLang's HiCache tree with
        HiCache on), told to report released rows."""
        tree = tree_for(self.runner.token_to_kv_pool_allocator)
        if tree is not None and self.on_release not in tree.release_listeners:
            tree.release_listeners.append(self.on_release)
        return tree

    def _prefix_copy(self, batch: ScheduleBatch, req: Req, cached: int, full: FullKV) -> CompressedPrefix | None:
        """The compressed copy of a cached prefix ``req`` continues (``cached`` tokens matched in
        the tree), or None when it shares too little to draft from one."""
        tree = self.tree()
        if tree is None or cached < MIN_SHARED_PREFIX:
            return None
        copy = tree.copy_for(req, cached, COPY_GRAIN)
        if copy is not None:
            self.capture.forget(req.rid)
            self.count("prefix_copy_hits")
            return copy
        length = cached // COPY_GRAIN * COPY_GRAIN
        if length < MIN_SHARED_PREFIX:
            return None
        copy = CompressedPrefix(
            length, self.compressor.compress(full.slice(0, length), self._observation(batch, req, length, follows=True))
        )
        tree.keep_copy(req, copy)
        self.count("prefix_copies_made")
        return copy
