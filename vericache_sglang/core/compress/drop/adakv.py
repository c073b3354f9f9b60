"""Ada-KV (Feng et al., 2024) over SnapKV scores: a layer's budget is shared among its KV heads by
one top-k over all heads' scores (each head keeping at least ``alpha`` of an even share), so
heads with concentrated attention give tokens to heads with spread attention.

Where this differs from the paper: this project keeps the same token count per KV head within a
layer (one dense tensor per layer, as paged KV pools need). Head ``h`` is allotted ``B_h`` tokens by
Ada-KV; every head then holds ``max_h B_h`` slots, filled with its own top-scored tokens, which
contain its Ada-KV selection. Drafting therefore attends to a superset of the paper's selection
and the layer costs ``heads * max_h B_h`` slots, not ``ratio * heads * n``: ``nbytes`` reports
the real size, and ``allotted`` the paper's per-head counts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vericache_sglang.core.compress.base import DroppedLayer, KeepingDropper, check_ratio
from vericache_sglang.core.compress.drop.scoring import budget, top_per_head
from vericache_sglang.core.compress.drop.snapkv import observed_scores
from vericache_sglang.core.compress.observation import Observation


@dataclass
class AdaKVParams:
    """Ada-KV (Feng et al. 2024, arXiv:2407.11550) over SnapKV's scores: a layer's budget shared among its KV heads.

    Parameters
    ----------
    ratio : float
        Each KV head's even share, as a fraction of the prompt's ``n`` tokens: ``min(n, max(window,
        ceil(ratio * n)))``. The layer's budget, ``kv_heads`` times that, is allotted by one top-k over all
        heads' scores; every head then holds the largest allotment (module docstring). In (0, 1].
    window : int
        Observation window in tokens, as SnapKV's (L_obs): always kept, part of every head's allotment. >= 1.
    kernel : int
        Pooling width in tokens, as SnapKV's. Odd, >= 1.
    pool : str
        ``"max"`` or ``"avg"``, as SnapKV's.
    alpha : float
        The safeguard (kvpress's ``alpha_safeguard``): each head's top ``max(1, int(alpha * share))``
        tokens are allotted to it before the layer-wide top-k (none when 0). In [0, 1]; 1 gives every
        head its even share (SnapKV).
    """

    ratio: float = 0.25
    window: int = 32
    kernel: int = 7
    pool: str = "max"
    alpha: float = 0.2  # the safeguard: each head keeps at least alpha of an even share


class AdaKVLayer(DroppedLayer):
    def __init__(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, allotted: list[int]):
        super().__init__(keys, values, positions)
        self.allotted = allotted  # Ada-KV's per-head counts (the paper's selection)


def allot(scores: torch.Tensor, per_head: int, alpha: float) -> tuple[torch.Tensor, list[int]]:
    """Ada-KV's allocation of ``heads * per_head`` tokens over ``scores`` ``[heads, n]``: the
    safeguarded scores and how many tokens each head is allotted."""
    hk, n = scores.shape
    safe = max(1, int(per_head * alpha)) if alpha > 0 else 0
    scores = scores.clone()
    if safe:
        scores.scatter_(1, scores.topk(safe, dim=-1).indices, torch.finfo(scores.dtype).max)
    chosen = scores.flatten().topk(hk * per_head).indices // n
    return scores, torch.bincount(chosen, minlength=hk).tolist()


class AdaKV(KeepingDropper):
    name = "adakv"
    Params = AdaKVParams
    summary = "SnapKV scores, budget shared across a layer's heads by one top-k (padded to equal counts)"
    needs = frozenset({"window"})
    uniform_layers = False  # each layer's slot count is its own max_h B_h

    def validate(self) -> None:
        p = self.params
        check_ratio("adakv", p.ratio)
        if p.window < 1 or p.kernel < 1 or p.kernel % 2 == 0:
            raise ValueError(f"adakv: window must be >= 1 and kernel odd, got {p.window}, {p.kernel}")
        if p.pool not in ("max", "avg"):
            raise ValueError(f"adakv: pool must be 'max' or 'avg', got {p.pool!r}")
        if not 0.0 <= p.alpha <= 1.0:
            raise ValueError(f"adakv: alpha must be in [0, 1], got {p.alpha}")

    def compress_layer(self, layer_idx, k, v, obs: Observation | None) -> AdaKVLayer:
        hk, n, _ = k.shape
        p = self.params
        window = min(p.window, n)
        per_head = budget(p.ratio, n, floor=window)
        if per_head >= n:
            everything = torch.arange(n, dtype=torch.int32, device=k.device).expand(hk, -1).clone()
            return AdaKVLayer(k.clone(), v.clone(), everything, [n] * hk)
        scores = observed_scores(obs, layer_idx, window, k, p.kernel, p.pool)
        # The observation window is always kept (it is part of every head's allotment).
        scores = torch.cat([scores, torch.full((hk, window), float("inf"), device=k.device)], dim=1)
        scores, allotted = allot(scores, per_head, p.alpha)
        kept = DroppedLayer.gather(k, v, top_per_head(scores, max(allotted)))
        return AdaKVLayer(kept.keys, kept.values, kept.positions, allotted)
