"""TOVA (Oren et al., 2024): a fixed-size cache that, at every step, drops the token the current
query attends to least, attention averaged over all heads of the layer (so every head keeps the
same tokens). The prefill keeps the top tokens by the last prompt query's attention."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vericache_sglang.core.compress.base import Compressor, check_ratio
from vericache_sglang.core.compress.drop.h2o import ScoredLayer, require_queries
from vericache_sglang.core.compress.drop.scoring import attention_probs, budget
from vericache_sglang.core.compress.observation import Observation


@dataclass
class TOVAParams:
    """TOVA (Oren et al. 2024, arXiv:2401.06104): evict the token the current query attends to least.

    Parameters
    ----------
    ratio : float
        Cache capacity, as a fraction of the prompt's ``n`` tokens: ``max(1, ceil(ratio * n))`` tokens (at
        most ``n``), the same tokens for every KV head, fixed while decoding: each committed token evicts
        one. In (0, 1]. The paper bounds the cache at a fixed number of tokens (states); here it follows
        the prompt's length.
    """

    ratio: float = 0.25


class TOVA(Compressor):
    name = "tova"
    kind = "dropping"
    Params = TOVAParams
    summary = "the current query's attention averaged over heads; fixed budget, evicts the least attended"
    needs = frozenset({"window", "update_queries"})
    evicts = True

    def validate(self) -> None:
        check_ratio("tova", self.params.ratio)

    def compress_layer(self, layer_idx, k, v, obs: Observation | None) -> ScoredLayer:
        hk, n, _ = k.shape
        if obs is None:
            raise ValueError("tova needs the prefill's last query")
        last = obs.window_queries(layer_idx, 1)
        scores = attention_probs(last, k, causal_tail=False)[:, 0].mean(dim=0)  # [n]
        scores[-1] = float("inf")  # the last prompt token is the one decoding starts from
        capacity = budget(self.params.ratio, n)
        keep = scores.topk(capacity).indices.sort().values.expand(hk, -1)
        return ScoredLayer.keep(k, v, scores.expand(hk, -1), keep, capacity)

    def update_layer(self, layer, k, v, positions, q) -> ScoredLayer:
        assert isinstance(layer, ScoredLayer)
        q = require_queries("tova", q)
        hk = k.shape[0]
        for j in range(k.shape[1]):
            layer.append(k[:, j : j + 1], v[:, j : j + 1], positions[j : j + 1])
            attn = attention_probs(q[:, j : j + 1], layer.keys, causal_tail=False)[:, 0].mean(dim=0)
            layer.scores = attn.expand(hk, -1).contiguous()  # TOVA scores by the current step alone
            m = layer.num_tokens
            if m > layer.capacity:
                cols = torch.arange(m, device=k.device)
                layer.keep_columns(cols[cols != attn.argmin()].expand(hk, -1))
        return layer
