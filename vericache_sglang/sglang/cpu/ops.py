"""The CPU ops SGLang 0.5.23 imports from its kernel package, in plain torch.

With ``SGLANG_USE_CPU_ENGINE=1`` three of SGLang's modules import CPU ops from ``sgl_kernel`` at
import time. Its CPU build is compiled from source for AVX-512/AMX machines and is not on PyPI; on
other CPUs SGLang runs its native (torch) layers and torch_native attention, and needs only the two
ops below. ``platform`` serves this module as ``sgl_kernel`` where no real one is installed.

- ``murmur_hash32_cpu``: the hash behind SGLang's seeded draw (``multinomial_with_seed``, taken
  with ``--enable-deterministic-inference``), which SGLang calls as
  ``torch.ops.sgl_kernel.murmur_hash32_cpu`` on CPU tensors; the twin of its Triton
  ``murmur_hash32_kernel`` (``sglang/kernels/ops/sampling/murmur_hash.py``), bit for bit.

- ``copy_all_layer_kv_cache_cpu``: KV row moves inside the pool (``memory_pool.py``: pool set-up,
  ``move_kv_cache``), all layers at once through the buffers' base addresses.
- ``assign_req_to_token_pool_cpu``: writes freshly allocated slots into ``req_to_token`` rows
  (``allocation.py``: every decode step), the twin of SGLang's Triton ``assign_req_to_token_pool``.

The speculative modules also import seven more names at module level; neither plain generation nor
VeriCache calls them (VeriCache verifies a chain with its own acceptance). They are present so the
imports succeed, and raise a clear error naming the op if ever called.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

import torch

SOURCE = "vericache_sglang.sglang.cpu.ops (torch stand-ins for SGLang's CPU sgl_kernel ops)"


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor, strides: torch.Tensor, tgt_loc: torch.Tensor, src_loc: torch.Tensor
) -> None:
    """For every buffer ``i`` (base address ``data_ptrs[i]``, rows of ``strides[i]`` bytes), copy
    row ``src_loc[j]`` to row ``tgt_loc[j]`` for every ``j``. All sources are read before any row is
    written, so overlapping moves (a row both a source and a target) are safe."""
    if tgt_loc.numel() != src_loc.numel():
        raise ValueError(f"copy_all_layer_kv_cache_cpu: {tgt_loc.numel()} targets for {src_loc.numel()} sources")
    if data_ptrs.numel() != strides.numel():
        raise ValueError(f"copy_all_layer_kv_cache_cpu: {data_ptrs.numel()} buffers, {strides.numel()} strides")
    if tgt_loc.numel() == 0:
        return
    tgt, src = tgt_loc.to(torch.int64), src_loc.to(torch.int64)
    if int(torch.minimum(tgt.min(), src.min())) < 0:
        raise ValueError("copy_all_layer_kv_cache_cpu: negative row index")
    rows = int(torch.maximum(tgt.max(), src.max())) + 1  # the caller's rows are in its buffers
    for ptr, stride in zip(data_ptrs.tolist(), strides.tolist(), strict=True):
        raw = (ctypes.c_uint8 * (rows * int(stride))).from_address(int(ptr))
        view = torch.frombuffer(raw, dtype=torch.uint8).view(rows, int(stride))
        view[tgt] = view[src]  # advanced indexing gathers the sources into a copy first


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """For request ``i``: ``req_to_token[req_pool_indices[i], start[i]:end[i]]`` gets the next
    ``end[i] - start[i]`` entries of ``out_cache_loc`` (request ``i``'s come after those of every
    earlier request)."""
    if req_to_token.shape[1] != pool_len:
        raise ValueError(f"assign_req_to_token_pool_cpu: pool_len {pool_len}, rows of {req_to_token.shape[1]}")
    offset = 0
    for row, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist(), strict=True):
        n = end - start
        if n < 0 or end > pool_len:
            raise ValueError(f"assign_req_to_token_pool_cpu: positions [{start}, {end}) in a row of {pool_len}")
        req_to_token[row, start:end] = out_cache_loc[offset : offset + n].to(req_to_token.dtype)
        offset += n
    if offset > out_cache_loc.numel():
        raise ValueError(f"assign_req_to_token_pool_cpu: {offset} slots asked, {out_cache_loc.numel()} given")


_M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``x * c mod 2**32`` for ``x < 2**32`` in int64, in 16-bit halves so no product overflows."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def _rotl32(x: torch.Tensor, r: int) -> torch.Tensor:
    return ((x << r) | (x >> (32 - r))) & _M32


def _murmur3_mix(h: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    k = _mul32(_rotl32(_mul32(k, 0xCC9E2D51), 15), 0x1B873593)
    h = _rotl32(h ^ k, 13)
    return (_mul32(h, 5) + 0xE6546B64) & _M32


def murmur_hash32_cpu(seed: torch.Tensor, positions: torch.Tensor, col_indices: torch.Tensor) -> torch.Tensor:
    """``[n, m]`` uint32 MurmurHash3 of (seed ``[n]`` as two 32-bit blocks, position ``[n]``, column
    ``[m]``): the blocks SGLang's Triton kernel mixes, in its order, with its finaliser."""
    if seed.shape != positions.shape or seed.dim() != 1 or col_indices.dim() != 1:
        raise ValueError(
            f"murmur_hash32_cpu: seed {tuple(seed.shape)} and positions {tuple(positions.shape)} must be one "
            f"shape (n,), col_indices {tuple(col_indices.shape)} 1-D"
        )
    s = seed.to(torch.int64)  # a uint64 seed's bits; & and >> below read them as the kernel does
    h = torch.zeros((), dtype=torch.int64)
    h = _murmur3_mix(h, s & _M32)
    h = _murmur3_mix(h, (s >> 32) & _M32)
    h = _murmur3_mix(h, positions.to(torch.int64) & _M32)[:, None]
    h = _murmur3_mix(h, (col_indices.to(torch.int64) & _M32)[None, :]) ^ 16
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return (h ^ (h >> 16)).to(torch.uint32)


def register_torch_ops() -> None:
    """``torch.ops.sgl_kernel.murmur_hash32_cpu``, where SGLang's seeded draw calls it on CPU (once;
    ``convert_weight_packed`` stays unregistered, so SGLang stays off its AMX path)."""
    if hasattr(torch.ops.sgl_kernel, "murmur_hash32_cpu"):
        return
    name = "sgl_kernel::murmur_hash32_cpu"
    torch.library.define(name, "(Tensor seed, Tensor positions, Tensor col_indices) -> Tensor")
    torch.library.impl(name, "CPU")(murmur_hash32_cpu)


def _not_provided(name: str) -> Callable[..., Any]:
    def op(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"sgl_kernel.{name} is not available on this CPU: SGLang's CPU kernel package is not installed, "
            f"and {SOURCE} supplies only copy_all_layer_kv_cache_cpu, assign_req_to_token_pool_cpu, "
            "murmur_hash32_cpu. "
            "EAGLE/n-gram speculative decoding needs the real sgl_kernel CPU build."
        )

    op.__name__ = op.__qualname__ = name
    return op


# Imported at module level by sglang/kernels/ops/speculative/*; never called by plain generation or VeriCache.
IMPORT_ONLY = (
    "build_tree_kernel_efficient_cpu",
    "verify_tree_greedy_cpu",
    "assign_draft_cache_locs_contiguous_cpu",
    "assign_extend_cache_locs_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
    "rotate_input_ids_cpu",
)


def ops() -> dict[str, Callable[..., Any]]:
    """Every name the stand-in ``sgl_kernel`` module exports."""
    table: dict[str, Callable[..., Any]] = {name: _not_provided(name) for name in IMPORT_ONLY}
    table["copy_all_layer_kv_cache_cpu"] = copy_all_layer_kv_cache_cpu
    table["assign_req_to_token_pool_cpu"] = assign_req_to_token_pool_cpu
    return table
