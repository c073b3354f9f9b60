"""SnapKV (Li et al., 2024): score prompt tokens by the attention the last ``window`` prompt
queries pay them, smooth the scores with a 1-D pooling, keep the top tokens per KV head plus the
observation window itself.

Grouped-query attention: a KV head's score is the mean over its query heads (as kvpress does).
Every head keeps the same number of tokens (``ceil(ratio * tokens)``, at least the window).
Tokens committed during decoding are appended unscored, as in the paper.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from vericache_sglang.core.compress.base import DroppedLayer, KeepingDropper, check_ratio
from vericache_sglang.core.compress.observation import Observation


@dataclass
class SnapKVParams:
    """SnapKV (Li et al. 2024, arXiv:2404.14469): observation-window attention, pooled, top tokens per KV head.

    Parameters
    ----------
    ratio : float
        Tokens each KV head keeps, as a fraction of the prompt's ``n`` tokens, observation window
        included: ``min(n, max(window, ceil(ratio * n)))``. In (0, 1]; 1 keeps everything. The paper
        sets a token count instead; kvpress's ``compression_ratio`` is ``1 - ratio``.
    window : int
        Observation window, in tokens (the paper's L_obs): the last ``window`` prompt tokens, whose
        queries score the earlier ones and which are always kept. >= 1.
    kernel : int
        Width, in tokens, of the 1-D pooling over positions that smooths the scores (the paper's
        clustering step). Odd, >= 1; 1 leaves the scores as they are.
    pool : str
        ``"max"`` or ``"avg"`` (average over the positions in range, padding not counted).
    """

    ratio: float = 0.25
    window: int = 32
    kernel: int = 7
    pool: str = "max"


def snapkv_scores(q_obs: torch.Tensor, k: torch.Tensor, kernel: int, pool: str, causal: bool = True) -> torch.Tensor:
    """Scores ``[kv_heads, tokens - window]`` of the prefix tokens.

    ``q_obs`` is ``[q_heads, window, head_dim]``: the queries of the last ``window`` positions, or
    with ``causal=False`` of ``window`` tokens after all of ``k`` (which then see every key).
    """
    hq, window, d = q_obs.shape
    hk, n, _ = k.shape
    group = hq // hk
    keys = k.repeat_interleave(group, dim=0).float()
    logits = q_obs.float() @ keys.transpose(1, 2) / math.sqrt(d)  # [hq, window, n]
    # The window attends causally to itself.
    if causal:
        mask = torch.ones(window, window, dtype=torch.bool, device=k.device).triu(1)
        logits[:, :, n - window :].masked_fill_(mask, float("-inf"))
    probs = logits.softmax(dim=-1)[:, :, : n - window].sum(dim=1)  # [hq, n - window]
    probs = probs.view(hk, group, -1).mean(dim=1)
    pad = kernel // 2
    if pool == "max":
        return F.max_pool1d(probs.unsqueeze(1), kernel, stride=1, padding=pad).squeeze(1)
    return F.avg_pool1d(probs.unsqueeze(1), kernel, stride=1, padding=pad, count_include_pad=False).squeeze(1)


class SnapKV(KeepingDropper):
    name = "snapkv"
    Params = SnapKVParams
    summary = "observation-window attention scores, pooled, top tokens per KV head"
    needs = frozenset({"window"})

    def validate(self) -> None:
        p = self.params
        check_ratio(self.name, p.ratio)
        if p.window < 1:
            raise ValueError(f"{self.name}: window must be >= 1, got {p.window}")
        if p.kernel < 1 or p.kernel % 2 == 0:
            raise ValueError(f"{self.name}: kernel must be an odd number >= 1, got {p.kernel}")
        if p.pool not in ("max", "avg"):
            raise ValueError(f"{self.name}: pool must be 'max' or 'avg', got {p.pool!r}")

    def budget(self, n: int) -> int:
        return min(n, max(self.params.window, math.ceil(self.params.ratio * n)))

    def compress_layer(self, layer_idx, k, v, obs: Observation | None) -> DroppedLayer:
        hk, n, _ = k.shape
        budget, window = self.budget(n), self.params.window
        if budget >= n:
            return DroppedLayer.gather(k, v, torch.arange(n, device=k.device).expand(hk, -1))
        scores = observed_scores(obs, layer_idx, window, k, self.params.kernel, self.params.pool)
        top = scores.topk(budget - window, dim=-1).indices
        recent = torch.arange(n - window, n, device=k.device).expand(hk, -1)
        keep = torch.cat([top, recent], dim=1).sort(dim=1).values
        return DroppedLayer.gather(k, v, keep)


def obs_window(obs: Observation | None, layer_idx: int, window: int) -> torch.Tensor:
    if obs is None:
        raise ValueError("snapkv needs the prefill's observation queries")
    return obs.window_queries(layer_idx, window)


def observed_scores(
    obs: Observation | None, layer_idx: int, window: int, k: torch.Tensor, kernel: int, pool: str
) -> torch.Tensor:
    """SnapKV's scores of layer ``layer_idx``'s keys ``k`` by the observation's last ``window`` queries."""
    return snapkv_scores(obs_window(obs, layer_idx, window), k, kernel, pool, causal=not obs.follows)
