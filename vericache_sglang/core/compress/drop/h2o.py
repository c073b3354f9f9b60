"""H2O (Zhang et al., 2023): heavy hitters by accumulated attention plus the most recent tokens,
evicting online as decoding goes.

Every token's score is the attention all later queries paid it (the prefill's causal attention,
then each committed token's query); the cache holds a fixed ``ceil(ratio * prompt)`` tokens per
KV head: the ``recent`` share of it for the newest tokens, the rest for the highest scores.
Committed tokens are folded in one at a time, as token-by-token decoding would, so a chunk of
verified tokens evicts exactly what one-by-one H2O evicts. Grouped-query attention: a KV head's
score is the mean over its query heads (as kvpress does).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vericache_sglang.core.compress.base import Compressor, DroppedLayer, check_ratio
from vericache_sglang.core.compress.drop.scoring import (
    accumulated_attention,
    attention_probs,
    budget,
    per_kv_head,
    top_per_head,
)
from vericache_sglang.core.compress.observation import Observation


class ScoredLayer(DroppedLayer):
    """Kept tokens with a running score each and a fixed capacity (online-evicting compressors)."""

    def __init__(
        self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, scores: torch.Tensor, capacity: int
    ):
        super().__init__(keys, values, positions)
        self.scores = scores  # [kv_heads, tokens], float32
        self.capacity = capacity

    @classmethod
    def keep(
        cls, k: torch.Tensor, v: torch.Tensor, scores: torch.Tensor, keep: torch.Tensor, capacity: int
    ) -> ScoredLayer:
        d = DroppedLayer.gather(k, v, keep)
        return cls(d.keys, d.values, d.positions, scores.gather(1, keep), capacity)

    @property
    def nbytes(self) -> int:
        return super().nbytes + self.scores.nbytes

    def keep_columns(self, cols: torch.Tensor) -> None:
        super().keep_columns(cols)
        self.scores = self.scores.gather(1, cols).contiguous()


def require_queries(name: str, q: torch.Tensor | None) -> torch.Tensor:
    if q is None:
        raise ValueError(f"{name} scores committed tokens online: update needs their queries")
    return q


@dataclass
class H2OParams:
    """H2O (Zhang et al. 2023, arXiv:2306.14048): heavy hitters by accumulated attention plus recent tokens.

    Parameters
    ----------
    ratio : float
        Cache capacity per KV head, as a fraction of the prompt's ``n`` tokens: ``max(1, ceil(ratio * n))``
        tokens (at most ``n``), fixed while decoding: each committed token evicts one. In (0, 1]. The
        paper's KV cache budget (heavy hitters and recent tokens together).
    recent : float
        Share of that capacity kept for the most recent tokens: ``int(recent * capacity)`` tokens; the
        rest hold the highest accumulated-attention scores. In [0, 1); 0.5 splits it evenly.
    """

    ratio: float = 0.25
    recent: float = 0.5  # share of the budget kept for the most recent tokens


class H2O(Compressor):
    name = "h2o"
    kind = "dropping"
    Params = H2OParams
    summary = "accumulated attention (heavy hitters) plus recent tokens; fixed budget, evicts online"
    needs = frozenset({"prompt", "update_queries"})
    evicts = True

    def validate(self) -> None:
        check_ratio("h2o", self.params.ratio)
        if not 0.0 <= self.params.recent < 1.0:
            raise ValueError(f"h2o: recent must be in [0, 1), got {self.params.recent}")

    def _recent(self, capacity: int) -> int:
        return int(self.params.recent * capacity)

    def compress_layer(self, layer_idx, k, v, obs: Observation | None) -> ScoredLayer:
        hk, n, _ = k.shape
        q = (obs or Observation()).model("h2o").prompt_queries()[layer_idx]
        scores = per_kv_head(accumulated_attention(q, k), hk)
        capacity = budget(self.params.ratio, n)
        recent = self._recent(capacity)
        heavy = top_per_head(scores[:, : n - recent], capacity - recent)
        tail = torch.arange(n - recent, n, device=k.device).expand(hk, -1)
        return ScoredLayer.keep(k, v, scores, torch.cat([heavy, tail], dim=1), capacity)

    def update_layer(self, layer, k, v, positions, q) -> ScoredLayer:
        assert isinstance(layer, ScoredLayer)
        q = require_queries("h2o", q)
        hk = k.shape[0]
        recent = self._recent(layer.capacity)
        for j in range(k.shape[1]):
            layer.append(k[:, j : j + 1], v[:, j : j + 1], positions[j : j + 1])
            layer.scores = torch.cat([layer.scores, layer.scores.new_zeros(hk, 1)], dim=1)
            probs = attention_probs(q[:, j : j + 1], layer.keys, causal_tail=False)[:, 0]
            layer.scores += per_kv_head(probs, hk)
            m = layer.num_tokens
            if m > layer.capacity:  # evict the lowest-scored token outside the recent window
                victim = layer.scores[:, : m - recent].argmin(dim=1, keepdim=True)
                cols = torch.arange(m, device=k.device).expand(hk, -1)
                layer.keep_columns(cols[cols != victim].view(hk, m - 1))
        return layer
