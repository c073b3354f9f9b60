"""Per-token quantization (int8, int4) and its rotated form (RotateKV).

``int8`` / ``int4``: every token's keys and values quantized asymmetrically over groups of
``group`` channels, one float16 (scale, min) per group; committed tokens are quantized as they
arrive. ``rotatekv`` (after Su et al., 2025): a normalised Hadamard rotation of each head's pre-RoPE
keys and of its values spreads outlier channels over all channels before per-token quantization;
reading rotates back and re-applies RoPE at each token's position. RotateKV's grouped-head
rotation and attention-sink-aware scaling are not reproduced: heads are rotated one by one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vericache_sglang.core.compress.base import QuantizingCompressor
from vericache_sglang.core.compress.observation import Observation
from vericache_sglang.core.compress.quant.kivi import QuantBlocks
from vericache_sglang.core.compress.quant.quant import dequantize, quantize, unpack
from vericache_sglang.core.compress.rope import Rope
from vericache_sglang.core.kv import CompressedLayer


def check_group(name: str, head_dim: int, group: int) -> None:
    if head_dim % group:
        raise ValueError(f"{name}: head_dim {head_dim} is not a multiple of group {group}")


class TokenQuantLayer(CompressedLayer):
    """Keys and values quantized per token over channel groups, appended block by block."""

    def __init__(self, bits: int, group: int, dtype: torch.dtype):
        self.bits, self.group, self.dtype = bits, group, dtype
        self.k_blocks, self.v_blocks = QuantBlocks(bits), QuantBlocks(bits)
        self.tokens = 0

    def add(self, k: torch.Tensor, v: torch.Tensor) -> None:
        h, n, d = k.shape
        for blocks, x in ((self.k_blocks, k), (self.v_blocks, v)):
            codes, scale, mn = quantize(x.reshape(h, n, d // self.group, self.group), dim=3, bits=self.bits)
            blocks.add(codes.reshape(h, n, d), scale, mn)
        self.tokens += n

    def _dequantize(self, blocks: QuantBlocks) -> torch.Tensor:
        parts = []
        for packed, scale, mn in zip(blocks.codes, blocks.scales, blocks.mins, strict=True):
            codes = unpack(packed, self.bits)
            h, n, d = codes.shape
            parts.append(dequantize(codes.view(h, n, d // self.group, self.group), scale, mn, self.dtype).view(h, n, d))
        return torch.cat(parts, dim=1)

    @property
    def nbytes(self) -> int:
        return self.k_blocks.nbytes + self.v_blocks.nbytes

    @property
    def num_tokens(self) -> int:
        return self.tokens

    def read(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self._dequantize(self.k_blocks), self._dequantize(self.v_blocks)


@dataclass
class IntParams:
    """Per-token asymmetric integer quantization (``int8``, ``int4``): a plain baseline, no paper of its own.

    Parameters
    ----------
    group : int
        Channels per (scale, min) pair: each token's keys and values are quantized over groups of
        ``group`` consecutive channels, one float16 scale and minimum per group. >= 1; head_dim must be
        a multiple (checked at compression). The bit width is the compressor's (``int8``: 8, ``int4``:
        4), not a parameter.
    """

    group: int = 32


class Int8(QuantizingCompressor):
    name = "int8"
    bits = 8
    Params = IntParams
    summary = "per-token asymmetric 8-bit keys and values over channel groups"

    def validate(self) -> None:
        if self.params.group < 1:
            raise ValueError(f"{self.name}: group must be >= 1, got {self.params.group}")

    def quantize_layer(self, layer_idx, k, v, positions, obs) -> TokenQuantLayer:
        check_group(self.name, k.shape[2], self.params.group)
        layer = TokenQuantLayer(self.bits, self.params.group, k.dtype)
        layer.add(k, v)
        return layer

    def update_layer(self, layer, k, v, positions, q) -> TokenQuantLayer:
        assert isinstance(layer, TokenQuantLayer)
        layer.add(k, v)
        return layer


class Int4(Int8):
    name = "int4"
    bits = 4
    summary = "per-token asymmetric 4-bit keys and values over channel groups"


def hadamard(d: int) -> torch.Tensor:
    """The normalised Sylvester Hadamard matrix of size ``d`` (a power of two): orthogonal, symmetric."""
    if d < 1 or d & (d - 1):
        raise ValueError(f"rotatekv: head_dim {d} is not a power of two")
    h = torch.ones(1, 1)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], dim=1), torch.cat([h, -h], dim=1)], dim=0)
    return h / d**0.5


class RotatedLayer(TokenQuantLayer):
    """Per-token quantized Hadamard-rotated pre-RoPE keys and rotated values."""

    def __init__(self, bits: int, group: int, dtype: torch.dtype, rope: Rope, rotation: torch.Tensor):
        super().__init__(bits, group, dtype)
        self.rope, self.rotation = rope, rotation
        self.positions = torch.empty(0, 0, dtype=torch.int32)

    def add_at(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        r = self.rotation.to(k.device)
        pre = self.rope.unrotate(k.float(), positions)
        super().add(pre @ r, v.float() @ r)
        self.positions = (
            positions.to(torch.int32)
            if not self.positions.numel()
            else torch.cat([self.positions, positions.to(torch.int32).to(self.positions.device)], dim=1)
        )

    @property
    def nbytes(self) -> int:
        return super().nbytes + self.positions.nbytes

    def read(self) -> tuple[torch.Tensor, torch.Tensor]:
        r = self.rotation.to(self.positions.device)
        k = self.rope.rotate(self._dequantize(self.k_blocks).float() @ r.T, self.positions)
        return k.to(self.dtype), (self._dequantize(self.v_blocks).float() @ r.T).to(self.dtype)


@dataclass
class RotateKVParams:
    """RotateKV (Su et al. 2025, arXiv:2501.16383), simplified: Hadamard-rotated pre-RoPE keys and values.

    Parameters
    ----------
    bits : int
        Code width in bits of the rotated keys and values, quantized per token: 2 or 4.
    group : int
        Channels per (scale, min) pair, per token, as ``IntParams.group``. >= 1; head_dim must be a
        multiple of it and a power of two (the Hadamard rotation), both checked at compression.
    """

    bits: int = 2
    group: int = 64


class RotateKV(QuantizingCompressor):
    name = "rotatekv"
    Params = RotateKVParams
    summary = "Hadamard-rotated pre-RoPE keys and values, per-token 2/4-bit"
    needs = frozenset({"rope"})

    def validate(self) -> None:
        if self.params.bits not in (2, 4):
            raise ValueError(f"rotatekv: bits must be 2 or 4, got {self.params.bits}")
        if self.params.group < 1:
            raise ValueError(f"rotatekv: group must be >= 1, got {self.params.group}")

    def quantize_layer(self, layer_idx, k, v, positions, obs) -> RotatedLayer:
        check_group("rotatekv", k.shape[2], self.params.group)
        rope = (obs or Observation()).model("rotatekv").rope()
        layer = RotatedLayer(self.params.bits, self.params.group, k.dtype, rope, hadamard(k.shape[2]))
        layer.add_at(k, v, positions)
        return layer

    def update_layer(self, layer, k, v, positions, q) -> RotatedLayer:
        assert isinstance(layer, RotatedLayer)
        layer.add_at(k, v, positions.to(k.device, torch.int32).expand(k.shape[0], -1))
        return layer
