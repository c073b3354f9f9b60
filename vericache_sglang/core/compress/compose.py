"""Composition: a token dropper, then a quantizer over the tokens it keeps
(``snapkv:ratio=0.25+kivi:bits=4``). The dropper chooses, the quantizer stores; tokens committed
later are appended to the quantizer, so the dropper must be one that never evicts what it kept
(sliding windows and online evictors cannot follow a quantizer's packed blocks)."""

from __future__ import annotations

import torch

from vericache_sglang.core.compress.base import Compressor, DroppedLayer, QuantizingCompressor
from vericache_sglang.core.compress.observation import Observation
from vericache_sglang.core.kv import CompressedKV, CompressedLayer, FullKV


class ComposedLayer(CompressedLayer):
    def __init__(self, positions: torch.Tensor, inner: CompressedLayer):
        self.positions = positions  # [kv_heads, tokens] int32: what the inner layer's columns hold
        self.inner = inner

    @property
    def nbytes(self) -> int:
        return self.inner.nbytes + self.positions.nbytes

    @property
    def num_tokens(self) -> int:
        return self.inner.num_tokens

    def read(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inner.read()

    def read_with_drafts(
        self, offset: int, k: torch.Tensor, v: torch.Tensor, query: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        return self.inner.read_with_drafts(offset, k, v, query)

    @property
    def reserved_nbytes(self) -> int:
        return self.inner.reserved_nbytes

    def held_positions(self) -> torch.Tensor:
        return self.positions  # every kept token, quantized or in the exact residual

    def exact_kv(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        exact = self.inner.exact_kv()
        if exact is None:
            return None
        cols, k, v = exact
        return self.positions.gather(1, cols.to(self.positions.device).long()), k, v


class Composed(Compressor):
    kind = "composed"
    Params = dict  # unused: the parts carry the parameters

    def __init__(self, dropper: Compressor, quantizer: Compressor):
        if dropper.kind != "dropping":
            raise ValueError(
                f"composition {dropper.name}+{quantizer.name}: the first part must be a token "
                f"dropper, {dropper.name} is a {dropper.kind} compressor (write dropper+quantizer)"
            )
        if not isinstance(quantizer, QuantizingCompressor):
            raise ValueError(
                f"composition {dropper.name}+{quantizer.name}: the second part must be a quantizer, "
                f"{quantizer.name} is a {quantizer.kind} compressor"
            )
        if dropper.evicts:
            raise ValueError(
                f"composition {dropper.name}+{quantizer.name}: {dropper.name} evicts tokens while "
                "decoding, which a quantizer's packed blocks cannot follow; compose a dropper that "
                "keeps what it chose (snapkv, pyramidkv, adakv, knorm, expected_attention, kvzip)"
            )
        self.dropper, self.quantizer = dropper, quantizer
        self.name = f"{dropper.name}+{quantizer.name}"
        self.needs = dropper.needs | quantizer.needs
        self.document_scoring = dropper.document_scoring
        self.uniform_layers = dropper.uniform_layers
        self.mode = "offline" if "offline" in (dropper.mode, quantizer.mode) else "online"

    @property
    def base_spec(self) -> str:
        return f"{self.dropper.base_spec}+{self.quantizer.base_spec}"

    def compress(self, full: FullKV, obs: Observation | None = None) -> CompressedKV:
        dropped = self.dropper.compress(full, obs)
        layers = []
        for i, layer in enumerate(dropped.layers):
            assert isinstance(layer, DroppedLayer)
            inner = self.quantizer.quantize_layer(i, layer.keys, layer.values, layer.positions, obs)
            layers.append(ComposedLayer(layer.positions, inner))
        return CompressedKV(full.layout, self.base_spec, layers)

    def compress_layer(self, layer_idx, k, v, obs: Observation | None) -> CompressedLayer:
        raise NotImplementedError("a composition compresses all layers at once: use compress()")

    def update_layer(self, layer, k, v, positions, q) -> ComposedLayer:
        assert isinstance(layer, ComposedLayer)
        pos = positions.to(torch.int32).to(layer.positions.device).expand(k.shape[0], -1)
        layer.inner = self.quantizer.update_layer(layer.inner, k, v, positions, q)
        layer.positions = torch.cat([layer.positions, pos], dim=1)
        return layer
