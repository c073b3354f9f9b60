"""The worker's side of the prompt prefixes loaded from the store behind the prefill pass
(``full_kv/layer_loads.py``): the pass reads them per layer as they arrive, and every step ends
with no load in flight. A load that failed was already promised to the tree; where a request of the
prefill batch read it, its positions are recomputed from the prompt's tokens into its slots (the
K/V of the same tokens over the same prefix: exact) and the pass runs again; where none did, its
nodes leave the tree. The request's tokens come from the second pass only.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from vericache_sglang.sglang.full_kv.layer_loads import LayerLoads, PrefixLoad

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    from vericache_sglang.sglang.draft.radix_cache import VeriCacheRadixCache
    from vericache_sglang.sglang.full_kv.offload import FullKVOffload

logger = logging.getLogger(__name__)

# (batch, committed lengths, batch index, first position, slots): ``Passes.recompute``
Recompute = Callable[["ScheduleBatch", "torch.Tensor", int, int, "torch.Tensor"], None]


class PrefixRepair:
    def __init__(
        self,
        offload: FullKVOffload | None,
        recompute: Recompute,
        tree: Callable[[], VeriCacheRadixCache | None],
        rows: ReqToTokenPool,
    ):
        # only the store tier loads prefixes
        self.loads: LayerLoads | None = getattr(getattr(offload, "tier", None), "layer_loads", None)
        self.req_to_token = rows.req_to_token  # a request's matched prefix starts its row
        self.recompute = recompute
        self.tree = tree
        self.recomputed = 0  # failed loads recomputed for the batch that read them

    def reading(self) -> contextlib.AbstractContextManager[None]:
        """Around the prefill pass: it waits per layer for the prefixes still arriving."""
        return self.loads.reading() if self.loads is not None else contextlib.nullcontext()

    def settle(self, batch: ScheduleBatch | None) -> bool:
        """End every load in flight; True when a failed one read by ``batch`` (a prefill batch) was
        recomputed, and its pass must run again."""
        if self.loads is None:
            return False
        rerun = False
        for load in self.loads.settle():
            index, start = self._reader(batch, load)
            if index is not None:
                logger.info("VeriCache: recomputing positions [%d, %d) a failed prefix load left", start, load.end)
                self.recompute(batch, batch.seq_lens.cpu(), index, start, load.slots)
                self.loads.dealt(load)
                self.recomputed += 1
                rerun = True
            elif self._dropped(load):
                self.loads.dealt(load)
        return rerun

    def _reader(self, batch: ScheduleBatch | None, load: PrefixLoad) -> tuple[int | None, int]:
        """The batch index of a request whose matched prefix (its row's first ``prefix_len``
        slots) holds ``load``'s slots, and the position they start at in it."""
        first = int(load.slots[0])
        for i, req in enumerate(batch.reqs if batch is not None else ()):
            held = self.req_to_token[req.kv.req_pool_idx, : req.prefix_len].to(torch.int64)
            at = (held == first).nonzero()
            if at.numel():
                return i, int(at[0, 0])
        return None, 0

    def _dropped(self, load: PrefixLoad) -> bool:
        tree = self.tree()
        return tree is None or tree.drop(load)
