"""Moving KV between SGLang's token pools and the core's FullKV / CompressedKV objects.

SGLang's ``MHATokenToKVPool`` keeps, per layer, ``[slots, kv_heads, head_dim]`` buffers indexed by
slot; the core keeps ``[kv_heads, tokens, head_dim]`` per layer. These helpers read a request's
rows out of a pool (to compress them or to store them as full KV) and write a compressed copy's
kept tokens into the private draft pool. They use the pools' internal (non-waiting) buffer
accessors: the public ``get_key_buffer`` waits on HiCache's layer counter, which is for attention.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import torch

from vericache_sglang.core.compress import Compressor, Observation
from vericache_sglang.core.kv import CompressedKV, FullKV, KVLayout

if TYPE_CHECKING:
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool


def pool_layout(pool: MHATokenToKVPool, model_id: str) -> KVLayout:
    """The core layout of an SGLang MHA pool's KV."""
    return KVLayout(model_id, pool.layer_num, pool.head_num, pool.head_dim, pool.dtype)


def _layer_buffers(pool: MHATokenToKVPool, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    return pool._get_key_buffer(pool.start_layer + layer), pool._get_value_buffer(pool.start_layer + layer)


def write_layer(pool: MHATokenToKVPool, slots: torch.Tensor, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
    """Write one layer's ``(keys, values)`` ``[kv_heads, n, head_dim]`` into the pool at ``slots``."""
    idx = slots.to(device=pool.device, dtype=torch.int64)
    k_buf, v_buf = _layer_buffers(pool, layer)
    k_buf[idx] = k.transpose(0, 1).to(device=k_buf.device, dtype=k_buf.dtype)
    v_buf[idx] = v.transpose(0, 1).to(device=v_buf.device, dtype=v_buf.dtype)


def _write_layers(
    pool: MHATokenToKVPool, slots: torch.Tensor, layers: Iterable[tuple[torch.Tensor, torch.Tensor]]
) -> None:
    """Write per-layer ``(keys, values)`` ``[kv_heads, n, head_dim]`` into the pool at ``slots``."""
    for layer, (k, v) in enumerate(layers):
        write_layer(pool, slots, layer, k, v)


def read_full_kv(pool: MHATokenToKVPool, indices: torch.Tensor, layout: KVLayout) -> FullKV:
    """The exact KV at pool slots ``indices`` (one request's tokens, in order)."""
    idx = indices.to(device=pool.device, dtype=torch.int64)
    layers = []
    for layer in range(layout.num_layers):
        k_buf, v_buf = _layer_buffers(pool, layer)
        layers.append((k_buf[idx].transpose(0, 1).contiguous(), v_buf[idx].transpose(0, 1).contiguous()))
    return FullKV(layout, layers)


class PoolParts(Sequence):
    """One request's exact KV in a pool, per layer on demand: ``parts[layer]`` is
    ``[(keys, values)]`` ``[kv_heads, n, head_dim]`` at ``indices`` (the core's "full KV in parts"),
    gathered when asked, so a reader that walks layers holds one layer's copy at a time."""

    def __init__(self, pool: MHATokenToKVPool, indices: torch.Tensor, num_layers: int):
        self.pool = pool
        self.idx = indices.to(device=pool.device, dtype=torch.int64)
        self.num_layers = num_layers

    def __len__(self) -> int:
        return self.num_layers

    def __getitem__(self, layer: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if not 0 <= layer < self.num_layers:
            raise IndexError(layer)
        k_buf, v_buf = _layer_buffers(self.pool, layer)
        return [(k_buf[self.idx].transpose(0, 1), v_buf[self.idx].transpose(0, 1))]


def compress_from_pool(
    pool: MHATokenToKVPool,
    indices: torch.Tensor,
    layout: KVLayout,
    compressor: Compressor,
    obs: Observation | None = None,
) -> CompressedKV:
    """A compressed copy of the KV at ``indices``, made by ``compressor`` (its ``compress``)."""
    return compressor.compress(read_full_kv(pool, indices, layout), obs)


def write_kept_tokens(pool: MHATokenToKVPool, slots: torch.Tensor, compressed: CompressedKV) -> None:
    """Write a token-dropping compressed copy into a private draft pool at ``slots``.

    Layer ``l`` keeps ``n_l`` tokens, written into the first ``n_l`` slots (one req_to_token row
    serves all layers; ``draft/layer_rows.py`` gives each layer its own count); per-head positions
    may differ, since attention only reads each head's own K/V.
    """
    counts = compressed.tokens_per_layer()
    if slots.numel() != max(counts):
        raise ValueError(f"{slots.numel()} slots for up to {max(counts)} kept tokens a layer")
    for layer, comp in enumerate(compressed.layers):
        k, v = comp.read()
        write_layer(pool, slots[: k.shape[1]], layer, k, v)


def write_full_kv(pool: MHATokenToKVPool, slots: torch.Tensor, full: FullKV) -> None:
    """Write exact KV (e.g. a prefix fetched from the store) into a pool at ``slots``."""
    if slots.numel() != full.num_tokens:
        raise ValueError(f"{slots.numel()} slots for {full.num_tokens} tokens")
    _write_layers(pool, slots, full.layers)
