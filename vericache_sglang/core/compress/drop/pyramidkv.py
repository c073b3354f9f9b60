"""PyramidKV (Cai et al., 2024): SnapKV's scoring with per-layer budgets shaped as a pyramid, more
tokens in lower layers, fewer in higher ones, the same total as SnapKV at that ratio.

The budget formula is KVCache-Factory's, as kvpress writes it with the ratio always applied:
``max_capacity = window + n * ratio``, ``min = (max_capacity - window) / beta``,
``max = 2 * (max_capacity - window) - min`` (capped at ``n - window``), layer ``l`` keeps
``round(max - l * (max - min) / (layers - 1))``, never fewer than the window. kvpress falls back to
SnapKV's uniform budget whenever ``min < window`` (any prompt under ~5k tokens at ratio 1/4); here
the top layers are clamped at the window instead, so a 2k-token prompt still gets a pyramid. Each
layer keeps its observation window.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vericache_sglang.core.compress.base import DroppedLayer
from vericache_sglang.core.compress.drop.snapkv import SnapKV, observed_scores
from vericache_sglang.core.compress.observation import Observation
from vericache_sglang.core.kv import CompressedKV, FullKV


@dataclass
class PyramidKVParams:
    """PyramidKV (Cai et al. 2024, arXiv:2406.02069): SnapKV's scores with pyramid-shaped per-layer budgets.

    Parameters
    ----------
    ratio : float
        Mean tokens kept per KV head over the layers, as a fraction of the prompt's ``n`` tokens
        (observation window included): layer budgets fall linearly from the bottom layer to the top and
        average ``ratio * n`` before the top layers are clamped at ``window`` (module docstring). In (0, 1].
        kvpress's ``compression_ratio`` is ``1 - ratio``.
    window : int
        Observation window in tokens, as SnapKV's (L_obs), kept by every layer. >= 1.
    kernel : int
        Pooling width in tokens, as SnapKV's. Odd, >= 1.
    pool : str
        ``"max"`` or ``"avg"``, as SnapKV's.
    beta : int
        The paper's beta: the top layer's budget is the mean budget over ``beta``, the bottom layer's
        twice the mean minus that (capped at ``n - window``). >= 1; 1 is flat, larger is steeper.
    """

    ratio: float = 0.25
    window: int = 64
    kernel: int = 5
    pool: str = "avg"
    beta: int = 20


def pyramid_budgets(n: int, ratio: float, window: int, beta: int, layers: int) -> list[int]:
    max_capacity = window + n * ratio
    lo = (max_capacity - window) / beta
    hi = (max_capacity - window) * 2 - lo
    if hi >= n - window:
        hi = n - window
        lo = (max_capacity - window) * 2 - hi
    if not (n >= hi >= lo) or layers == 1:
        return [max(1, round(n * ratio))] * layers
    step = (hi - lo) / (layers - 1)
    return [max(window, round(hi - layer * step)) for layer in range(layers)]


class PyramidKV(SnapKV):
    name = "pyramidkv"
    Params = PyramidKVParams
    summary = "SnapKV scores with pyramid-shaped per-layer budgets (more in lower layers)"
    uniform_layers = False

    def validate(self) -> None:
        super().validate()
        if self.params.beta < 1:
            raise ValueError(f"pyramidkv: beta must be >= 1, got {self.params.beta}")

    def compress(self, full: FullKV, obs: Observation | None = None) -> CompressedKV:
        p = self.params
        budgets = pyramid_budgets(full.num_tokens, p.ratio, p.window, p.beta, full.layout.num_layers)
        layers = [self._keep(i, k, v, obs, b) for i, ((k, v), b) in enumerate(zip(full.layers, budgets, strict=True))]
        return CompressedKV(full.layout, self.base_spec, layers)

    def compress_layer(self, layer_idx, k, v, obs: Observation | None) -> DroppedLayer:
        raise NotImplementedError("pyramidkv budgets depend on the layer count: use compress()")

    def _keep(
        self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, obs: Observation | None, count: int
    ) -> DroppedLayer:
        hk, n, _ = k.shape
        window = min(self.params.window, n)
        count = min(n, max(count, window))
        if count >= n:
            return DroppedLayer.gather(k, v, torch.arange(n, device=k.device).expand(hk, -1))
        scores = observed_scores(obs, layer_idx, window, k, self.params.kernel, self.params.pool)
        top = scores.topk(count - window, dim=-1).indices
        recent = torch.arange(n - window, n, device=k.device).expand(hk, -1)
        return DroppedLayer.gather(k, v, torch.cat([top, recent], dim=1).sort(dim=1).values)
