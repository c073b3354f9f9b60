"""Triton kernel: unpack 2/4/8-bit codes and dequantize them with float16 scales and minima.

It reads the layout of ``vericache_sglang.core.compress.quant.quant`` (codes packed along the last dim,
one (scale, min) per ``row_group`` rows and ``col_group`` columns), which is also its reference:
``quant.dequantize(quant.unpack(...))``. KIVI keys use ``row_group`` = the key group (per channel
over a token group); KIVI values use ``col_group`` = the value group (per token over a channel group).
"""

from __future__ import annotations

if not __name__.startswith("vericache_sglang."):
    raise ImportError("kernels/ is the package vericache_sglang.kernels; import it under that name")

import torch
import triton
import triton.language as tl


@triton.jit
def _dequant_rows(
    packed, scale, mn, out, D: tl.constexpr, BITS: tl.constexpr, ROW_GROUP: tl.constexpr, COL_GROUP: tl.constexpr
):
    row = tl.program_id(0)
    cols = tl.arange(0, D)
    per_byte: tl.constexpr = 8 // BITS
    byte = tl.load(packed + row * (D // per_byte) + cols // per_byte).to(tl.int32)
    code = (byte >> ((cols % per_byte) * BITS)) & ((1 << BITS) - 1)
    sidx = (row // ROW_GROUP) * (D // COL_GROUP) + cols // COL_GROUP
    s = tl.load(scale + sidx).to(tl.float32)
    m = tl.load(mn + sidx).to(tl.float32)
    tl.store(out + row * D + cols, (code.to(tl.float32) * s + m).to(out.dtype.element_ty))


def dequantize_packed(
    packed: torch.Tensor,
    scale: torch.Tensor,
    mn: torch.Tensor,
    bits: int,
    *,
    row_group: int = 1,
    col_group: int = 1,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Dequantize ``packed`` ``[..., rows, D * bits / 8]`` to ``[..., rows, D]``.

    ``scale`` and ``mn`` hold ``rows / row_group`` by ``D / col_group`` entries (any leading shape
    that flattens to it). ``D`` must be a power of two.
    """
    per_byte = 8 // bits
    d = packed.shape[-1] * per_byte
    rows = packed.numel() // packed.shape[-1]
    if d & (d - 1):
        raise ValueError(f"last dim {d} is not a power of two")
    if scale.numel() != (rows // row_group) * (d // col_group) or scale.shape != mn.shape:
        raise ValueError(
            f"scale of {scale.numel()} entries does not fit {rows} rows of {d} in groups of {row_group} x {col_group}"
        )
    out = torch.empty((*packed.shape[:-1], d), dtype=dtype, device=packed.device)
    _dequant_rows[(rows,)](
        packed.contiguous(),
        scale.contiguous(),
        mn.contiguous(),
        out,
        D=d,
        BITS=bits,
        ROW_GROUP=row_group,
        COL_GROUP=col_group,
    )
    return out
