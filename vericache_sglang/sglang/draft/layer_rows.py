"""Per-layer budgets in one draft row: each layer attends to its own kept count.

SGLang's kernels read one ``req_to_token`` row and one ``seq_len`` per request for every layer.
A compressor whose layers keep different counts (PyramidKV's pyramid, Ada-KV's per-layer maxima,
KVzip's ranking over all layers) gets a row of ``M`` kept slots (its largest layer's count), then
the scratch slots; layer ``l`` holds its ``n_l`` kept tokens in the first ``n_l`` slots. While a
draft pass runs layer ``l``, ``LayerRowsBackend`` hands the wrapped backend a row table whose
rows list the first ``n_l`` kept slots and then the scratch slots, and ``seq_lens`` shortened by
``M - n_l``: each layer reads exactly its own kept tokens and the drafts, as the engine's
per-layer compressed KV does.

The swap is per call, so it serves the backends that read the row table and ``seq_lens`` at each
layer (torch_native and the plugin's chain backend: tested on CPU in real servers). The masked
GPU backends (triton, flashinfer, fa3) precompute their indices once a pass: per-layer budgets
are refused with them at launch (``config.check_layer_budgets``).

Memory: the plain pool holds ``M`` slots of every layer (SGLang's pools give every layer the same
slots); the dequantizing pool holds each layer's codes at its own count
(``dequant_pool.py``), so there a per-layer budget saves what it promises.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

    from vericache_sglang.sglang.draft.pool import CompressedDraftPool


class LayerRowsBackend:
    """``inner`` (a backend bound to the draft pools), each layer reading its own kept count."""

    def __init__(self, inner: AttentionBackend, pool: CompressedDraftPool, table: torch.Tensor | None = None):
        """``table``: another wrapper's, to share (one forward runs at a time, and each call
        rewrites the rows it reads)."""
        self.inner = inner
        self.pool = pool
        # the rows as one layer sees them, rewritten per call
        self.table = torch.zeros_like(pool.req_to_token_pool.req_to_token) if table is None else table
        self._view = SimpleNamespace(req_to_token=self.table)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        self.inner.init_forward_metadata(forward_batch)

    def forward(self, q, k, v, layer, forward_batch: ForwardBatch, save_kv_cache: bool = True, **kwargs):
        with self._layer(layer.layer_id, forward_batch):
            return self.inner.forward(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)

    @contextlib.contextmanager
    def _layer(self, layer_id: int, fb: ForwardBatch) -> Iterator[None]:
        rows = fb.req_pool_indices.tolist()
        short = self.pool.shortfalls(rows, layer_id)
        if not any(short):
            yield
            return
        for r in rows:
            slots = self.pool.layer_slots(r, layer_id)
            self.table[r, : slots.numel()] = slots.to(self.table.dtype)
        cut = torch.tensor(short, dtype=fb.seq_lens.dtype, device=fb.seq_lens.device)
        saved = (fb.seq_lens, fb.seq_lens_cpu, self.inner.req_to_token_pool)
        fb.seq_lens = fb.seq_lens - cut
        if fb.seq_lens_cpu is not None:
            fb.seq_lens_cpu = fb.seq_lens_cpu - cut.cpu().to(fb.seq_lens_cpu.dtype)
        self.inner.req_to_token_pool = self._view
        try:
            yield
        finally:
            fb.seq_lens, fb.seq_lens_cpu, self.inner.req_to_token_pool = saved
