"""StreamingLLM (Xiao et al., 2023): keep the first ``sink`` tokens and the most recent ``window``.

Kept tokens keep their original positions (keys are stored after RoPE), as kvpress's
StreamingLLMPress does; the original paper re-rotates keys to cache-relative positions instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vericache_sglang.core.compress.base import Compressor, DroppedLayer
from vericache_sglang.core.compress.observation import Observation


@dataclass
class StreamingLLMParams:
    """StreamingLLM (Xiao et al. 2023, arXiv:2309.17453): attention sinks plus a recent window.

    The budget is a token count, not a ratio: every KV head holds ``min(n, sink + window)`` tokens of
    the prompt's ``n``, then ``sink + window`` once committed tokens have filled it, the same for all heads.

    Parameters
    ----------
    sink : int
        Attention sinks, in tokens: the first ``sink`` prompt tokens, always kept. >= 0 (the paper keeps 4).
    window : int
        Recent tokens kept after the sinks, in tokens (the paper's rolling cache): the newest ``window``,
        prompt then committed tokens, the oldest evicted as tokens are committed. >= 1.
    """

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
