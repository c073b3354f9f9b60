"""StreamingLLM (Xiao et al., 2023): keep the first ``sink`` tokens and the most recent ``window``.

Kept tokens keep their original positions (keys are stored after RoPE), as kvpress's
StreamingLLMPress does; the original paper re-rotates keys to cache-relative positions instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vericache_sglang.core.compress.base import Compressor, DroppedLayer, Observation


@dataclass
class StreamingLLMParams:
    sink: int = 4
    window: int = 512


class StreamingLLM(Compressor):
    name = "streamingllm"
    kind = "dropping"
    Params = StreamingLLMParams
    summary = "attention sinks plus a recent window (positional, the same tokens for every head)"
    document_scoring = "query-agnostic: positions (sinks and the recent window)"
    evicts = True

    def validate(self) -> None:
        if self.params.sink < 0:
            raise ValueError(f"streamingllm: sink must be >= 0, got {self.params.sink}")
        if self.params.window < 1:
            raise ValueError(f"streamingllm: window must be >= 1, got {self.params.window}")

    def _keep(self, n: int) -> torch.Tensor:
        sink, window = self.params.sink, self.params.window
        if n <= sink + window:
            return torch.arange(n)
        return torch.cat([torch.arange(sink), torch.arange(n - window, n)])

    def compress_layer(self, layer_idx, k, v, obs: Observation | None) -> DroppedLayer:
        keep = self._keep(k.shape[1]).to(k.device).expand(k.shape[0], -1)
        return DroppedLayer.gather(k, v, keep)

    def update_layer(self, layer, k, v, positions, q) -> DroppedLayer:
        assert isinstance(layer, DroppedLayer)
        layer.append(k, v, positions)
        # the window's oldest tokens go; the sinks move on over them (a few rows, not the window)
        excess = layer.num_tokens - self.params.sink - self.params.window
        if excess > 0:
            layer.drop_columns(self.params.sink, excess)
        return layer
