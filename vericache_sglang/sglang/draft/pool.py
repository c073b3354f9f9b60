"""The worker's private compressed-KV pool, built from SGLang's own pool classes.

Each running request has one row in a private ``ReqToTokenPool``; the row lists the slots (in a
private ``MHATokenToKVPool``) of the tokens its compressor kept, followed by ``scratch`` slots
(``horizon``; ``2 * horizon + 1`` with lookup chains, which may be fed, padded, at a window's end)
that a draft pass writes its drafted tokens' K/V into. Drafted K/V is scratch: after a
verification the request's compressed KV is updated through the compressor's ``update`` with the
*committed* tokens' exact K/V (read from the target pool the verify pass wrote), its refreshed
rows re-chosen (``+refresh``: from the verify pass's attention over the full KV, still on the
device), and the row is rewritten from it. The draft attention backend (attention.py) reads these pools.

A quantizing compressor's rows (``quantized``) keep their codes in the compressed KV only; the
private pool is then a ``DequantizingKVPool`` (``dequant_pool.py``): one layer dequantized where
attention reads it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

from vericache_sglang.core.compress import Compressor
from vericache_sglang.core.kv import CompressedKV, FullKV
from vericache_sglang.sglang.draft.attention import DraftPools
from vericache_sglang.sglang.draft.dequant_pool import DequantizingKVPool
from vericache_sglang.sglang.pool_kv import write_kept_tokens

if TYPE_CHECKING:
    from vericache_sglang.core.kv import KVLayout


def draft_capacity(compressor: Compressor, target_tokens: int) -> int:
    """Kept-token slots of the private pool: half the target pool's tokens for a token dropper
    (each slot a full-precision token of every layer); all of them for a quantizer, whose slot
    costs one layer's workspace (its codes live in the compressed KV)."""
    share = 1.0 if compressor.kind in ("quantization", "composed") else 0.5
    return max(4096, int(target_tokens * share))


class DraftPoolFull(RuntimeError):
    """The compressed pool has no room for another request's row (the scheduler retries later)."""


@dataclass
class _Row:
    index: int  # row in the private ReqToTokenPool
    slots: torch.Tensor  # kept-token slots, then the scratch slots
    kv: CompressedKV
    next_position: int  # absolute position of the next token to commit

    counts: list[int]  # kept tokens per layer (the row's kept slots: the largest)

    @property
    def kept(self) -> int:
        return max(self.counts)


class CompressedDraftPool:
    def __init__(
        self,
        *,
        layout: KVLayout,
        capacity_tokens: int,
        max_requests: int,
        max_context_len: int,
        horizon: int,
        compressor: Compressor,
        device: str,
        inner_backend: str = "triton",
        scratch: int | None = None,
    ):
        self.layout = layout
        self.horizon = horizon
        self.scratch = horizon if scratch is None else scratch
        self.compressor = compressor
        self.req_to_token_pool = ReqToTokenPool(
            size=max_requests, max_context_len=max_context_len, device=device, enable_memory_saver=False
        )
        self.quantized = compressor.kind in ("quantization", "composed")
        if self.quantized:
            self.token_to_kv_pool = DequantizingKVPool(
                layout=layout,
                capacity=capacity_tokens,
                scratch=self.scratch,
                device=device,
                rows=lambda: (
                    (row.index, row.slots[: -self.scratch], row.slots[-self.scratch :], row.kv)
                    for row in self.rows.values()
                ),
            )
        else:
            self.token_to_kv_pool = MHATokenToKVPool(
                size=capacity_tokens,
                page_size=1,
                dtype=layout.dtype,
                head_num=layout.num_kv_heads,
                head_dim=layout.head_dim,
                layer_num=layout.num_layers,
                device=device,
                enable_memory_saver=False,
            )
        self.allocator = TokenToKVPoolAllocator(
            size=capacity_tokens, dtype=layout.dtype, device=device, kvcache=self.token_to_kv_pool, need_sort=False
        )
        self.pools = DraftPools(self.req_to_token_pool, self.token_to_kv_pool, self.allocator, inner_backend)
        self.rows: dict[str, _Row] = {}
        self._by_index: dict[int, _Row] = {}  # private row index -> its row
        # layers may keep different counts (``layer_rows.py``): the draft backends read per layer
        self.per_layer = not compressor.uniform_layers

    # -- lifecycle ------------------------------------------------------------------------------

    def admit(self, rid: str, kv: CompressedKV, num_tokens: int) -> int:
        """Take a request's compressed prompt KV (``num_tokens`` prompt tokens); returns its row."""
        if rid in self.rows:
            raise ValueError(f"request {rid} already has a draft row")
        if not self.per_layer and len(set(kv.tokens_per_layer())) != 1:
            raise ValueError(f"draft rows need one kept-token count for all layers, got {kv.tokens_per_layer()}")
        indices = self.req_to_token_pool.alloc_rows(1)
        if not indices:
            raise DraftPoolFull("no free draft row")
        row = _Row(indices[0], torch.empty(0, dtype=torch.int64), kv, num_tokens, [])
        try:
            self._write_row(row)
        except DraftPoolFull:
            self.req_to_token_pool.free_rows([row.index])
            raise
        self.rows[rid] = row
        self._by_index[row.index] = row
        return row.index

    def commit(
        self,
        rid: str,
        full: FullKV,
        positions: torch.Tensor,
        refresh: tuple[Sequence[Sequence[tuple[torch.Tensor, torch.Tensor]]], list[torch.Tensor]] | None = None,
    ) -> None:
        """Fold committed tokens' exact K/V ``full`` (at absolute ``positions``) into the row.

        ``refresh``: the request's whole full KV in parts per layer (up to and including these
        tokens) and these tokens' verify queries per layer ``[q_heads, n, d]``; the compressor
        re-chooses its refreshed rows from them (its ``refresh``), as the reference engine does
        right after a commit. The row keeps its token count."""
        row = self.rows[rid]
        if int(positions[0]) != row.next_position or positions.numel() != full.num_tokens:
            raise ValueError(f"commit at positions {positions.tolist()[:3]}..., the row expects {row.next_position}")
        for layer, (k, v) in enumerate(full.layers):
            self.compressor.update(row.kv, layer, k, v, positions)
        if refresh is not None:
            self.compressor.refresh(row.kv, *refresh)
        row.next_position += full.num_tokens
        self.allocator.free(row.slots)
        self._write_row(row)

    def release(self, rid: str) -> None:
        row = self.rows.pop(rid, None)
        if row is None:
            return
        self._by_index.pop(row.index, None)
        self.allocator.free(row.slots)
        self.req_to_token_pool.free_rows([row.index])
        if self.quantized:
            self.token_to_kv_pool.forget(row.index)

    # -- what a draft pass reads ------------------------------------------------------------------

    def has(self, rid: str) -> bool:
        return rid in self.rows

    def row_index(self, rid: str) -> int:
        return self.rows[rid].index

    def kept_len(self, rid: str) -> int:
        return self.rows[rid].kept

    def next_position(self, rid: str) -> int:
        return self.rows[rid].next_position

    def scratch_slots(self, rid: str) -> torch.Tensor:
        row = self.rows[rid]
        return row.slots[row.kept :]

    def nbytes(self) -> int:
        return sum(row.kv.nbytes for row in self.rows.values())

    def shortfalls(self, indices: Sequence[int], layer_id: int) -> list[int]:
        """Per private row: how many of its kept slots layer ``layer_id`` leaves unread."""
        layer = layer_id - self.token_to_kv_pool.start_layer
        return [(row := self._by_index[i]).kept - row.counts[layer] for i in indices]

    def layer_slots(self, index: int, layer_id: int) -> torch.Tensor:
        """Private row ``index`` as layer ``layer_id`` reads it: its kept slots, then the scratch."""
        row = self._by_index[index]
        n = row.counts[layer_id - self.token_to_kv_pool.start_layer]
        return torch.cat([row.slots[:n], row.slots[row.kept :]])

    def _write_row(self, row: _Row) -> None:
        row.counts = row.kv.tokens_per_layer()
        kept = row.kept
        slots = self.allocator.alloc(kept + self.scratch)
        if slots is None:
            raise DraftPoolFull(f"no room for {kept + self.scratch} draft tokens")
        if self.quantized:
            self.token_to_kv_pool.changed()  # the rows are read, dequantized, when attention asks
        else:
            write_kept_tokens(self.token_to_kv_pool, slots[:kept], row.kv)
        self.req_to_token_pool.write((row.index, slice(0, slots.numel())), slots.to(torch.int32))
        row.slots = slots
