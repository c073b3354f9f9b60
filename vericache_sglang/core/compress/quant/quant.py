"""Asymmetric integer quantization with bit packing: the torch reference the Triton kernels match.

Codes are packed little-end-first along the last dimension (``8 // bits`` codes per byte), and
scales and minima are kept in float16, so the byte sizes reported are the bytes really held.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

SUPPORTED_BITS = (2, 4, 8)
SCALE_DTYPE = torch.float16


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integer codes in ``[0, 2**bits)`` along the last dim (its size a multiple of 8 // bits)."""
    per_byte = 8 // bits
    if codes.shape[-1] % per_byte:
        raise ValueError(f"last dim {codes.shape[-1]} is not a multiple of {per_byte}")
    c = codes.to(torch.uint8).view(*codes.shape[:-1], -1, per_byte)
    out = torch.zeros(c.shape[:-1], dtype=torch.uint8, device=codes.device)
    for i in range(per_byte):
        out |= c[..., i] << (bits * i)
    return out


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    codes = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return codes.view(*packed.shape[:-1], -1)


@functools.cache
def _code_table(bits: int, device: torch.device) -> torch.Tensor:
    """Every byte's codes as floats, ``[256, 8 // bits]``: unpacking becomes one table lookup."""
    per_byte = 8 // bits
    table = [[(b >> (bits * i)) & ((1 << bits) - 1) for i in range(per_byte)] for b in range(256)]
    return torch.tensor(table, dtype=torch.float32, device=device)


def dequantize_packed(
    packed: torch.Tensor, bits: int, scale: torch.Tensor, mn: torch.Tensor, grouped: tuple[int, ...], dtype: torch.dtype
) -> torch.Tensor:
    """``dequantize(unpack(packed).view(grouped), ...)`` bit for bit, in fewer passes over the
    output (codes come out of a table as floats, then scale and min in place): the draft path's
    per-step cost where no fused kernel attends to the codes directly."""
    codes = F.embedding(packed.long(), _code_table(bits, packed.device)).view(grouped)
    return codes.mul_(scale.float()).add_(mn.float()).to(dtype)


def dequantize_packed_into(
    out: torch.Tensor, packed: torch.Tensor, bits: int, scale: torch.Tensor, mn: torch.Tensor, grouped: tuple[int, ...]
) -> None:
    """``dequantize_packed(...)`` (float32) written into ``out`` (``[heads, n, dim]``, each head's
    rows contiguous: a slice of a larger buffer along ``n``), bit for bit: the same table lookup,
    scale and min, without a tensor of its own to be copied on."""
    table = _code_table(bits, packed.device)
    idx = packed.long()
    for h in range(out.shape[0]):
        torch.index_select(table, 0, idx[h].view(-1), out=out[h].view(-1, table.shape[1]))
    out.view(grouped).mul_(scale.float()).add_(mn.float())


def quantize(x: torch.Tensor, dim: int, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize ``x`` with one (scale, min) per slice reduced along ``dim``.

    Returns unpacked codes (uint8, same shape as ``x``) and float16 scale and min with ``dim``
    kept as size 1. Codes are computed against the float16-rounded scale and min, so
    ``dequantize`` reproduces exactly what was meant.
    """
    levels = (1 << bits) - 1
    xf = x.float()
    mn = xf.amin(dim=dim, keepdim=True).to(SCALE_DTYPE)
    mx = xf.amax(dim=dim, keepdim=True)
    scale = ((mx - mn.float()) / levels).to(SCALE_DTYPE)
    safe = torch.where(scale.float() > 0, scale.float(), torch.ones_like(scale, dtype=torch.float32))
    codes = ((xf - mn.float()) / safe).round_().clamp_(0, levels).to(torch.uint8)
    return codes, scale, mn


def dequantize(codes: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (codes.float() * scale.float() + mn.float()).to(dtype)
