"""The draft pool for quantizing compressors: codes in the compressed KV, one layer dequantized at a time.

A quantizing compressor (KIVI, KVQuant, the per-token int quantizers, alone or after a token
dropper) keeps each request's compressed KV as packed codes with their scales (``CompressedKV``:
the bytes ``nbytes`` counts). SGLang's attention kernels read a plain ``[slots, kv_heads,
head_dim]`` buffer per layer, so this pool, an ``MHATokenToKVPool`` to every backend, holds one
layer's worth of such a buffer, the *workspace*, and fills it with layer ``l``'s dequantized keys
and values when a backend first asks for layer ``l`` (``get_key_buffer``), as SGLang's own FP4 pool
dequantizes a layer where attention reads it. The model runs its layers in order, so one layer's
workspace serves a whole pass: the dequantized copy of the compressed KV never exists for all
layers at once.

A row's slots come from the caller's allocator, as in the plain pool: its kept tokens', then the
``scratch`` slots a draft pass writes its drafted tokens' K/V into. Scratch K/V is kept per row for
every layer in full precision (the later draft passes of the same step read it) and copied into
the workspace with the layer.

On CPU the dequantization is the compressor's own ``read`` in torch (tested in real servers); the
dequantize-fused Triton kernels in ``kernels/`` are not used here yet. On a GPU unverified.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

from vericache_sglang.core.kv import CompressedKV, KVLayout

# (row index, kept-token slots [n], scratch slots [scratch], compressed KV) of every row the pool serves
RowSource = Callable[[], Iterable[tuple[int, torch.Tensor, torch.Tensor, CompressedKV]]]


class DequantizingKVPool(MHATokenToKVPool):
    def __init__(self, *, layout: KVLayout, capacity: int, scratch: int, device: str, rows: RowSource):
        self.scratch = scratch
        self._rows = rows
        self._held: tuple[int, int] | None = None  # (layer, version) now in the workspace
        self.version = 0  # bumped by ``changed`` whenever a row's kept tokens or slots change
        self._lanes: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # row -> its scratch K, V [layers, scratch, ...]
        self._owner: tuple[int, torch.Tensor, torch.Tensor] | None = None  # (version, row of slot, lane offset of slot)
        super().__init__(
            size=capacity,
            page_size=1,
            dtype=layout.dtype,
            head_num=layout.num_kv_heads,
            head_dim=layout.head_dim,
            layer_num=layout.num_layers,
            device=device,
            enable_memory_saver=False,
        )

    def changed(self) -> None:
        """A row's kept tokens or slots changed: the workspace is refilled at the next read."""
        self.version += 1

    def forget(self, row: int) -> None:
        self._lanes.pop(row, None)
        self.changed()

    def _create_buffers_normal(self) -> None:
        rows = self.size + self.page_size
        ws_k = torch.zeros((rows, self.head_num, self.head_dim), dtype=self.dtype, device=self.device)
        ws_v = torch.zeros((rows, self.head_num, self.v_head_dim), dtype=self.dtype, device=self.device)
        self.k_buffer = [ws_k] * self.layer_num  # every layer's buffer is the workspace
        self.v_buffer = [ws_v] * self.layer_num

    def nbytes(self) -> int:
        """Bytes this pool holds: the one-layer workspace and the rows' scratch lanes (the codes are
        the rows' ``CompressedKV``, counted by their ``nbytes``)."""
        lanes = sum(k.nbytes + v.nbytes for k, v in self._lanes.values())
        return self.k_buffer[0].nbytes + self.v_buffer[0].nbytes + lanes

    def _lane(self, row: int) -> tuple[torch.Tensor, torch.Tensor]:
        if row not in self._lanes:
            shape = (self.layer_num, self.scratch, self.head_num)
            self._lanes[row] = (
                torch.zeros((*shape, self.head_dim), dtype=self.dtype, device=self.device),
                torch.zeros((*shape, self.v_head_dim), dtype=self.dtype, device=self.device),
            )
        return self._lanes[row]

    def _owners(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per slot: the row whose scratch lane it is (-1: none) and its offset in the lane."""
        if self._owner is None or self._owner[0] != self.version:
            row_of = torch.full((self.size + self.page_size,), -1, dtype=torch.int64)
            offset = torch.zeros_like(row_of)
            for row, _, scratch, _ in self._rows():
                idx = scratch.to(torch.int64).cpu()
                row_of[idx] = row
                offset[idx] = torch.arange(idx.numel())
            self._owner = (self.version, row_of, offset)
        return self._owner[1], self._owner[2]

    def _hold(self, layer_id: int) -> None:
        layer = layer_id - self.start_layer
        if self._held == (layer, self.version):
            return
        ws_k, ws_v = self.k_buffer[0], self.v_buffer[0]
        for row, kept, scratch, kv in self._rows():
            k, v = kv.layers[layer].read()
            idx = kept[: k.shape[1]].to(device=ws_k.device, dtype=torch.int64)  # this layer's own count
            ws_k[idx] = k.transpose(0, 1).to(ws_k.dtype)
            ws_v[idx] = v.transpose(0, 1).to(ws_v.dtype)
            if row in self._lanes:
                lane = scratch.to(device=ws_k.device, dtype=torch.int64)
                ws_k[lane] = self._lanes[row][0][layer]
                ws_v[lane] = self._lanes[row][1][layer]
        self._held = (layer, self.version)

    def _get_key_buffer(self, layer_id: int) -> torch.Tensor:
        self._hold(layer_id)
        return self.k_buffer[0]

    def _get_value_buffer(self, layer_id: int) -> torch.Tensor:
        self._hold(layer_id)
        return self.v_buffer[0]

    def set_kv_buffer(
        self, layer: Any, loc_info: Any, cache_k: torch.Tensor, cache_v: torch.Tensor, *args: Any, **kwargs: Any
    ) -> None:
        """A draft pass's tokens: into their rows' scratch lanes (every layer's, kept for the step)
        and, when the workspace holds this layer, into it too (this layer's attention reads them next)."""
        from sglang.srt.mem_cache.memory_pool import unwrap_write_loc

        loc, _, _ = unwrap_write_loc(loc_info)
        layer_id = kwargs.get("layer_id_override") or layer.layer_id
        local = layer_id - self.start_layer
        idx = loc.to(torch.int64)
        row_of, offset = self._owners()
        rows, offsets = row_of[idx.cpu()], offset[idx.cpu()]
        if idx.numel() and int(rows.min()) < 0:
            raise ValueError(
                "the dequantizing draft pool takes writes in its rows' scratch slots only, "
                f"got slots {idx.tolist()[:4]}..."
            )
        k = cache_k.reshape(-1, self.head_num, self.head_dim).to(self.dtype)
        v = cache_v.reshape(-1, self.head_num, self.v_head_dim).to(self.dtype)
        for row in rows.unique().tolist():
            mine = rows == row
            lane_k, lane_v = self._lane(row)
            lane_k[local, offsets[mine]] = k[mine.to(k.device)]
            lane_v[local, offsets[mine]] = v[mine.to(v.device)]
        if self._held is not None and self._held[0] == local:
            self.k_buffer[0][idx] = k
            self.v_buffer[0][idx] = v
