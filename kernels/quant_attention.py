"""Triton kernel: one-query (decode) attention read straight from packed quantized K/V.

Drafting over a quantized cache is memory-bound: reading 2- or 4-bit codes instead of 16-bit
values is the point, so the kernel never materialises dequantized K/V. Each program serves one
query head: it walks its KV head's tokens in blocks, unpacks and dequantizes keys and values in
registers (one float16 (scale, min) per ``row_group`` tokens and ``col_group`` channels, the layout
of ``vericache_sglang.core.compress.quant.quant``, which covers KIVI's per-channel keys, KIVI's and
int4/int8's per-token values and keys), and keeps an online softmax.

``quant_attention_reference`` is the torch reference the kernel is tested against: dequantize,
then plain softmax attention.
"""

from __future__ import annotations

if not __name__.startswith("vericache_sglang."):
    raise ImportError("kernels/ is the package vericache_sglang.kernels; import it under that name")

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from vericache_sglang.core.compress.quant.quant import dequantize, unpack


@dataclass(frozen=True)
class PackedKV:
    """One side (keys or values) of one layer: ``codes`` ``[kv_heads, n, D * bits / 8]`` uint8,
    ``scale``/``mn`` float16 ``[kv_heads, n / row_group, D / col_group]``."""

    codes: torch.Tensor
    scale: torch.Tensor
    mn: torch.Tensor
    bits: int
    row_group: int = 1
    col_group: int = 1

    @property
    def head_dim(self) -> int:
        return self.codes.shape[-1] * (8 // self.bits)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        h, n, _ = self.codes.shape
        d, rg, cg = self.head_dim, self.row_group, self.col_group
        codes = unpack(self.codes, self.bits).view(h, n // rg, rg, d // cg, cg)
        out = dequantize(
            codes, self.scale.view(h, n // rg, 1, d // cg, 1), self.mn.view(h, n // rg, 1, d // cg, 1), dtype
        )
        return out.view(h, n, d)


def quant_attention_reference(q: torch.Tensor, k: PackedKV, v: PackedKV, scale: float | None = None) -> torch.Tensor:
    """``q`` ``[q_heads, D]`` (one decode step) over packed ``k``, ``v``: ``[q_heads, D]`` float32."""
    keys, values = k.dequantized(), v.dequantized()
    group = q.shape[0] // keys.shape[0]
    keys, values = keys.repeat_interleave(group, 0), values.repeat_interleave(group, 0)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    probs = torch.einsum("hd,hnd->hn", q.float(), keys).mul(scale).softmax(-1)
    return torch.einsum("hn,hnd->hd", probs, values)


@triton.jit
def _load_dequant(
    codes,
    scale,
    mn,
    head,
    start,
    n,
    D: tl.constexpr,
    BITS: tl.constexpr,
    ROW_GROUP: tl.constexpr,
    COL_GROUP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    rows = start + tl.arange(0, BLOCK)
    cols = tl.arange(0, D)
    valid = rows < n
    per_byte: tl.constexpr = 8 // BITS
    byte = tl.load(
        codes + head * n * (D // per_byte) + rows[:, None] * (D // per_byte) + cols[None, :] // per_byte,
        mask=valid[:, None],
        other=0,
    ).to(tl.int32)
    code = (byte >> ((cols[None, :] % per_byte) * BITS)) & ((1 << BITS) - 1)
    groups_per_head = (n // ROW_GROUP) * (D // COL_GROUP)
    sidx = head * groups_per_head + (rows[:, None] // ROW_GROUP) * (D // COL_GROUP) + cols[None, :] // COL_GROUP
    s = tl.load(scale + sidx, mask=valid[:, None], other=0.0).to(tl.float32)
    m = tl.load(mn + sidx, mask=valid[:, None], other=0.0).to(tl.float32)
    return code.to(tl.float32) * s + m, valid


@triton.jit
def _quant_decode_attention(
    q,
    k_codes,
    k_scale,
    k_min,
    v_codes,
    v_scale,
    v_min,
    out,
    n,
    sm_scale,
    GROUP: tl.constexpr,
    D: tl.constexpr,
    K_BITS: tl.constexpr,
    K_RG: tl.constexpr,
    K_CG: tl.constexpr,
    V_BITS: tl.constexpr,
    V_RG: tl.constexpr,
    V_CG: tl.constexpr,
    BLOCK: tl.constexpr,
):
    qh = tl.program_id(0)
    kh = qh // GROUP
    cols = tl.arange(0, D)
    query = tl.load(q + qh * D + cols).to(tl.float32) * sm_scale
    m_i = -float("inf")
    l_i = 0.0
    acc = tl.zeros([D], dtype=tl.float32)
    for start in range(0, n, BLOCK):
        keys, valid = _load_dequant(k_codes, k_scale, k_min, kh, start, n, D, K_BITS, K_RG, K_CG, BLOCK)
        logits = tl.sum(keys * query[None, :], axis=1)
        logits = tl.where(valid, logits, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(logits, axis=0))
        p = tl.exp(logits - m_new)
        alpha = tl.exp(m_i - m_new)
        values, _ = _load_dequant(v_codes, v_scale, v_min, kh, start, n, D, V_BITS, V_RG, V_CG, BLOCK)
        acc = acc * alpha + tl.sum(p[:, None] * values, axis=0)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        m_i = m_new
    tl.store(out + qh * D + cols, acc / l_i)


def quant_decode_attention(
    q: torch.Tensor, k: PackedKV, v: PackedKV, scale: float | None = None, block: int = 32
) -> torch.Tensor:
    """The kernel: the same contract as ``quant_attention_reference``."""
    hq, d = q.shape
    hk, n, _ = k.codes.shape
    if d & (d - 1) or k.head_dim != d or v.head_dim != d:
        raise ValueError(f"head_dim must be a power of two shared by q, k and v: {d}, {k.head_dim}, {v.head_dim}")
    if hq % hk or v.codes.shape[:2] != (hk, n):
        raise ValueError(f"{hq} query heads over keys {tuple(k.codes.shape)} and values {tuple(v.codes.shape)}")
    for side in (k, v):
        if (
            n % side.row_group
            or d % side.col_group
            or side.scale.numel() != hk * (n // side.row_group) * (d // side.col_group)
        ):
            raise ValueError(
                f"scales of {side.scale.numel()} entries do not fit {hk} heads x {n} rows x {d} "
                f"in groups of {side.row_group} x {side.col_group}"
            )
    if n == 0:
        raise ValueError("attention over zero tokens")
    out = torch.empty(hq, d, dtype=torch.float32, device=q.device)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    _quant_decode_attention[(hq,)](
        q.contiguous(),
        k.codes.contiguous(),
        k.scale.contiguous(),
        k.mn.contiguous(),
        v.codes.contiguous(),
        v.scale.contiguous(),
        v.mn.contiguous(),
        out,
        n,
        scale,
        GROUP=hq // hk,
        D=d,
        K_BITS=k.bits,
        K_RG=k.row_group,
        K_CG=k.col_group,
        V_BITS=v.bits,
        V_RG=v.row_group,
        V_CG=v.col_group,
        BLOCK=block,
    )
    return out
