"""KVQuant (Hooper et al., 2024), dense-and-sparse: keys quantized per channel before RoPE, values
per token, with the outliers of each kept sparse in full precision.

Key ranges are calibrated per (head, channel) on the prompt's pre-RoPE keys: the
``outliers / 2`` quantiles at each end bound the dense range, and later keys reuse those ranges
(KVQuant calibrates offline; here the prompt is the calibration set). A value is an outlier when
it falls outside its range; it is kept as (flat index, value). Value ranges are per token, so
each token's own extremes are its outliers. Reading dequantizes, puts the outliers back and
re-applies RoPE at each token's position. KVQuant's non-uniform (nuq) datatypes are not
reproduced: codes are uniform.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vericache_sglang.core.compress.base import QuantizingCompressor
from vericache_sglang.core.compress.observation import Observation
from vericache_sglang.core.compress.quant.quant import SCALE_DTYPE, dequantize, pack, unpack
from vericache_sglang.core.compress.rope import Rope
from vericache_sglang.core.kv import CompressedLayer


def quantile_range(x: torch.Tensor, dim: int, outliers: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``outliers / 2`` and ``1 - outliers / 2`` order statistics of ``x`` along ``dim`` (kept)."""
    n = x.shape[dim]
    cut = int(n * outliers / 2)
    if cut == 0:
        return x.amin(dim=dim, keepdim=True), x.amax(dim=dim, keepdim=True)
    lo = x.kthvalue(cut + 1, dim=dim, keepdim=True).values
    hi = x.kthvalue(n - cut, dim=dim, keepdim=True).values
    return lo, hi


@dataclass
class DenseSparse:
    """Packed codes over a range, plus the values outside it."""

    shape: tuple[int, ...]
    codes: torch.Tensor  # packed uint8
    scale: torch.Tensor  # float16, broadcast against ``shape``
    mn: torch.Tensor
    index: torch.Tensor  # int32 flat indices of the outliers
    value: torch.Tensor  # their exact values

    @classmethod
    def encode(cls, x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, bits: int) -> DenseSparse:
        levels = (1 << bits) - 1
        xf = x.float()
        mn = lo.to(SCALE_DTYPE)
        scale = ((hi.float() - mn.float()) / levels).to(SCALE_DTYPE)
        top = mn.float() + scale.float() * levels
        outlier = (xf < mn.float()) | (xf > top)
        safe = torch.where(scale.float() > 0, scale.float(), torch.ones_like(scale, dtype=torch.float32))
        codes = ((xf - mn.float()) / safe).round_().clamp_(0, levels).to(torch.uint8)
        index = outlier.flatten().nonzero().squeeze(1).to(torch.int32)
        return cls(tuple(x.shape), pack(codes, bits), scale, mn, index, x.flatten()[index.long()].clone())

    def decode(self, bits: int, dtype: torch.dtype) -> torch.Tensor:
        out = dequantize(unpack(self.codes, bits), self.scale, self.mn, dtype)
        out.view(-1)[self.index.long()] = self.value.to(dtype)
        return out

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.codes, self.scale, self.mn, self.index, self.value))


class KVQuantLayer(CompressedLayer):
    def __init__(
        self, bits: int, outliers: float, dtype: torch.dtype, rope: Rope, k_lo: torch.Tensor, k_hi: torch.Tensor
    ):
        self.bits, self.outliers, self.dtype, self.rope = bits, outliers, dtype, rope
        self.k_lo, self.k_hi = k_lo.to(SCALE_DTYPE), k_hi.to(SCALE_DTYPE)  # [heads, 1, d], calibrated
        self.keys: list[DenseSparse] = []
        self.values: list[DenseSparse] = []
        self.positions = torch.empty(0, 0, dtype=torch.int32)

    def add(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        pre = self.rope.unrotate(k.float(), positions)
        self.keys.append(DenseSparse.encode(pre, self.k_lo, self.k_hi, self.bits))
        self.values.append(DenseSparse.encode(v, *quantile_range(v.float(), 2, self.outliers), self.bits))
        positions = positions.to(torch.int32)
        self.positions = (
            positions
            if not self.positions.numel()
            else torch.cat([self.positions, positions.to(self.positions.device)], dim=1)
        )

    @property
    def nbytes(self) -> int:
        return (
            sum(b.nbytes for b in (*self.keys, *self.values))
            + self.k_lo.nbytes
            + self.k_hi.nbytes
            + self.positions.nbytes
        )

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[1]

    def read(self) -> tuple[torch.Tensor, torch.Tensor]:
        pre = torch.cat([b.decode(self.bits, torch.float32) for b in self.keys], dim=1)
        k = self.rope.rotate(pre, self.positions).to(self.dtype)
        return k, torch.cat([b.decode(self.bits, self.dtype) for b in self.values], dim=1)


@dataclass
class KVQuantParams:
    """KVQuant (Hooper et al. 2024, arXiv:2401.18079): dense-and-sparse, with uniform codes.

    Parameters
    ----------
    bits : int
        Code width in bits of the dense part, for pre-RoPE keys (per channel) and values (per token):
        2, 4 or 8. The paper's nuq datatypes are non-uniform; these codes are uniform.
    outliers : float
        Fraction of each range's values kept sparse in full precision, ``int(count * outliers / 2)`` at
        each end. Key ranges, per (KV head, channel), are calibrated on the prompt's pre-RoPE keys and
        reused, so a later key outside them is an outlier too; value ranges are per token over its
        channels. In [0, 0.5). The paper's outlier share (0.01: its ``-1%`` variants).
    """

    bits: int = 4
    outliers: float = 0.01  # fraction of each range's values kept sparse in full precision


class KVQuant(QuantizingCompressor):
    name = "kvquant"
    Params = KVQuantParams
    summary = "per-channel pre-RoPE keys, per-token values, outliers kept sparse (dense-and-sparse)"
    needs = frozenset({"rope"})

    def validate(self) -> None:
        if self.params.bits not in (2, 4, 8):
            raise ValueError(f"kvquant: bits must be 2, 4 or 8, got {self.params.bits}")
        if not 0.0 <= self.params.outliers < 0.5:
            raise ValueError(f"kvquant: outliers must be in [0, 0.5), got {self.params.outliers}")

    def quantize_layer(self, layer_idx, k, v, positions, obs) -> KVQuantLayer:
        rope = (obs or Observation()).model("kvquant").rope()
        pre = rope.unrotate(k.float(), positions)
        lo, hi = quantile_range(pre, 1, self.params.outliers)
        layer = KVQuantLayer(self.params.bits, self.params.outliers, k.dtype, rope, lo, hi)
        layer.add(k, v, positions)
        return layer

    def update_layer(self, layer, k, v, positions, q) -> KVQuantLayer:
        assert isinstance(layer, KVQuantLayer)
        layer.add(k, v, positions.to(k.device, torch.int32).expand(k.shape[0], -1))
        return layer
