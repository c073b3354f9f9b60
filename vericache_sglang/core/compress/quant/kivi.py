"""KIVI (Liu et al., 2024): asymmetric 2/4-bit KV quantization, keys per channel, values per token.

Keys are quantized per channel over groups of ``group`` consecutive tokens; values per token over
groups of ``group`` channels. ``key_group`` and ``value_group`` set the two apart: with KIVI over
every token, the keys' grouping is what limits SmolLM2's drafting
(``benchmarks/results/drafting_deploy.md``). The newest tokens stay in full precision in a residual
of fewer than ``residual`` tokens; when it reaches ``residual`` tokens it is quantized as a block
(KIVI flushes keys this way; doing the same for values only changes which tokens sit in the
residual).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from vericache_sglang.core.compress.base import UNSET_OMITTED, QuantizingCompressor
from vericache_sglang.core.compress.quant.quant import dequantize_packed, dequantize_packed_into, pack, quantize
from vericache_sglang.core.kv import CompressedLayer
from vericache_sglang.core.rows import RowsField, in_inference_mode, workspace


@dataclass
class KIVIParams:
    """KIVI (Liu et al. 2024, arXiv:2402.02750): asymmetric quantization, keys per channel, values per token.

    Parameters
    ----------
    bits : int
        Code width in bits of keys and values: 2 or 4 (the paper's KIVI-2, KIVI-4).
    group : int
        Group size (the paper's G): keys share one (scale, min) per channel over ``group`` consecutive
        tokens, values one per token over ``group`` consecutive channels. >= 1; head_dim must be a
        multiple (checked at compression).
    residual : int
        Residual length in tokens (the paper's R): the newest tokens, fewer than ``residual``, stay in full
        precision; when the residual reaches ``residual`` tokens it is quantized as one block. A positive
        multiple of the key group.
    key_group : int
        Tokens per key (scale, min), per channel, when it differs from ``group``: 0 takes ``group``.
    value_group : int
        Channels per value (scale, min), per token, when it differs from ``group``: 0 takes ``group``.
    """

    bits: int = 2
    group: int = 32
    residual: int = 128
    key_group: int = field(default=0, metadata={UNSET_OMITTED: True})  # 0: group's; spelled when set
    value_group: int = field(default=0, metadata={UNSET_OMITTED: True})

    @property
    def groups(self) -> tuple[int, int]:
        """(tokens per key scale, channels per value scale)."""
        return self.key_group or self.group, self.value_group or self.group


class QuantBlocks:
    """Packed codes with their scales and minima, appended block by block along the token dim."""

    def __init__(self, bits: int):
        self.bits = bits
        self.codes: list[torch.Tensor] = []
        self.scales: list[torch.Tensor] = []
        self.mins: list[torch.Tensor] = []

    def add(self, codes: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor) -> None:
        self.codes.append(pack(codes, self.bits))
        self.scales.append(scale)
        self.mins.append(mn)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (*self.codes, *self.scales, *self.mins))


class KIVILayer(CompressedLayer):
    def __init__(
        self, bits: int, groups: tuple[int, int], dtype: torch.dtype, k_res: torch.Tensor, v_res: torch.Tensor
    ):
        self.bits, self.dtype = bits, dtype
        self.key_group, self.value_group = groups
        self.k_blocks = QuantBlocks(bits)
        self.v_blocks = QuantBlocks(bits)
        self.quantized_tokens = 0
        self.k_res, self.v_res = k_res, v_res

    # The full-precision residual, in buffers with room: commits append in place and a draft
    # window's tokens are written after it (one concatenation per read, not two).
    k_res = RowsField()
    v_res = RowsField()

    def append_residual(self, k: torch.Tensor, v: torch.Tensor, residual: int) -> None:
        """Append committed tokens to the residual; once it holds ``residual`` or more, quantize
        its whole multiples of ``residual`` as a block and keep the rest."""
        self._k_res_rows.append(k)
        self._v_res_rows.append(v)
        n = self._k_res_rows.length
        nq = n - n % residual
        if nq:
            self.quantize_block(self.k_res[:, :nq], self.v_res[:, :nq])
            self._k_res_rows.drop(0, nq)  # in place: the buffer's room stays for the next commits
            self._v_res_rows.drop(0, nq)

    def quantize_block(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Quantize ``k, v`` (``[heads, n, dim]``, ``n`` a multiple of the key group) and append them."""
        h, n, d = k.shape
        kg, vg = self.key_group, self.value_group
        kq, ks, km = quantize(k.reshape(h, n // kg, kg, d), dim=2, bits=self.bits)  # per channel
        self.k_blocks.add(kq.reshape(h, n, d), ks, km)
        vq, vs, vm = quantize(v.reshape(h, n, d // vg, vg), dim=3, bits=self.bits)  # per token
        self.v_blocks.add(vq.reshape(h, n, d), vs, vm)
        self.quantized_tokens += n

    @property
    def nbytes(self) -> int:
        return self.k_blocks.nbytes + self.v_blocks.nbytes + self.k_res.nbytes + self.v_res.nbytes

    @property
    def reserved_nbytes(self) -> int:
        return self._k_res_rows.reserved_nbytes + self._v_res_rows.reserved_nbytes

    @property
    def num_tokens(self) -> int:
        return self.quantized_tokens + self.k_res.shape[1]

    def _grouped(
        self, blocks: QuantBlocks, per_channel: bool
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple[int, ...]]]:
        """Each block's codes, scale, min and its ``[heads, n, dim]`` shape grouped as quantized:
        keys over tokens (per channel), values over channels (per token)."""
        kg, vg = self.key_group, self.value_group
        for packed, scale, mn in zip(blocks.codes, blocks.scales, blocks.mins, strict=True):
            h, n, d = packed.shape[0], packed.shape[1], packed.shape[2] * (8 // self.bits)
            yield packed, scale, mn, ((h, n // kg, kg, d) if per_channel else (h, n, d // vg, vg))

    def _dequantized(self, blocks: QuantBlocks, per_channel: bool) -> list[torch.Tensor]:
        """Each block as ``[heads, n, dim]`` in the model dtype."""
        return [
            dequantize_packed(packed, self.bits, scale, mn, grouped, self.dtype).view(*packed.shape[:2], -1)
            for packed, scale, mn, grouped in self._grouped(blocks, per_channel)
        ]

    def dequantized_keys(self) -> torch.Tensor:
        return torch.cat([*self._dequantized(self.k_blocks, per_channel=True), self.k_res], dim=1)

    def dequantized_values(self) -> torch.Tensor:
        return torch.cat([*self._dequantized(self.v_blocks, per_channel=False), self.v_res], dim=1)

    def read(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.dequantized_keys(), self.dequantized_values()

    @in_inference_mode
    def read_with_drafts(
        self, offset: int, k: torch.Tensor, v: torch.Tensor, query: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The dequantized blocks, the residual and the window's rows, assembled in a workspace
        (valid until the next layer's read: the runner attends to it at once). No fused kernel
        attends to the codes on a CPU, so they are dequantized each step, but written once,
        where attention reads them, not dequantized and then copied on by a concatenation."""
        k_tail, v_tail = self._k_res_rows.with_tail(offset, k), self._v_res_rows.with_tail(offset, v)
        if not self.quantized_tokens:
            return k_tail, v_tail
        if self.dtype != torch.float32:  # the table lookup is float32; other dtypes convert after
            return (
                torch.cat([*self._dequantized(self.k_blocks, per_channel=True), k_tail], dim=1),
                torch.cat([*self._dequantized(self.v_blocks, per_channel=False), v_tail], dim=1),
            )
        h, d, n = k_tail.shape[0], k_tail.shape[2], self.quantized_tokens + k_tail.shape[1]
        keys = workspace("kivi_keys", (h, n, d), k_tail.dtype, k_tail.device)
        values = workspace("kivi_values", (h, n, d), v_tail.dtype, v_tail.device)
        self._dequantize_into(keys, self.k_blocks, per_channel=True)
        self._dequantize_into(values, self.v_blocks, per_channel=False)
        keys[:, self.quantized_tokens :] = k_tail
        values[:, self.quantized_tokens :] = v_tail
        return keys, values

    def _dequantize_into(self, out: torch.Tensor, blocks: QuantBlocks, per_channel: bool) -> None:
        start = 0
        for packed, scale, mn, grouped in self._grouped(blocks, per_channel):
            n = packed.shape[1]
            dequantize_packed_into(out[:, start : start + n], packed, self.bits, scale, mn, grouped)
            start += n

    def exact_kv(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # The residual is exact; quantized tokens are not.
        h, r = self.k_res.shape[0], self.k_res.shape[1]
        pos = torch.arange(
            self.quantized_tokens, self.quantized_tokens + r, dtype=torch.int32, device=self.k_res.device
        )
        return pos.expand(h, -1), self.k_res, self.v_res


class KIVI(QuantizingCompressor):
    name = "kivi"
    Params = KIVIParams
    summary = "2/4-bit asymmetric; keys per channel, values per token; full-precision residual"

    def validate(self) -> None:
        p = self.params
        if p.bits not in (2, 4):
            raise ValueError(f"kivi: bits must be 2 or 4, got {p.bits}")
        if p.group < 1 or p.key_group < 0 or p.value_group < 0:
            raise ValueError(f"kivi: group sizes must be >= 1 (0: key_group and value_group take group), got {p}")
        kg = p.groups[0]
        if p.residual < kg or p.residual % kg:
            raise ValueError(f"kivi: residual ({p.residual}) must be a positive multiple of the key group ({kg})")

    def quantize_layer(self, layer_idx, k, v, positions, obs) -> KIVILayer:
        p = self.params
        if k.shape[2] % p.groups[1]:
            raise ValueError(f"kivi: head_dim {k.shape[2]} is not a multiple of the value group {p.groups[1]}")
        n = k.shape[1]
        nq = n - n % p.residual
        layer = KIVILayer(p.bits, p.groups, k.dtype, k[:, nq:].clone(), v[:, nq:].clone())
        if nq:
            layer.quantize_block(k[:, :nq], v[:, :nq])
        return layer

    def update_layer(self, layer, k, v, positions, q) -> KIVILayer:
        assert isinstance(layer, KIVILayer)
        layer.append_residual(k, v, self.params.residual)
        return layer
