"""Scoring pieces the token-dropping compressors share: attention probabilities under grouped-query
attention, and picking the same number of tokens per KV head."""

from __future__ import annotations

import math

import torch


def attention_probs(q: torch.Tensor, k: torch.Tensor, causal_tail: bool = True) -> torch.Tensor:
    """Softmax attention ``[q_heads, m, n]`` of queries ``q`` ``[q_heads, m, d]`` over keys
    ``k`` ``[kv_heads, n, d]`` (float32). With ``causal_tail`` the queries are the last ``m`` of
    the ``n`` positions and attend causally among themselves."""
    hq, m, d = q.shape
    hk, n, _ = k.shape
    keys = k.float().repeat_interleave(hq // hk, dim=0)
    logits = q.float() @ keys.transpose(1, 2) / math.sqrt(d)
    if causal_tail and m > 1:
        future = torch.ones(m, m, dtype=torch.bool, device=q.device).triu(1)
        logits[:, :, n - m :].masked_fill_(future, float("-inf"))
    return logits.softmax(dim=-1)


def per_kv_head(scores: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Mean of ``[q_heads, n]`` scores over each KV head's query group -> ``[kv_heads, n]``."""
    return scores.view(kv_heads, scores.shape[0] // kv_heads, -1).mean(dim=1)


def accumulated_attention(q: torch.Tensor, k: torch.Tensor, chunk: int = 256) -> torch.Tensor:
    """Column sums ``[q_heads, n]`` of the causal attention of all ``n`` prompt queries over the
    prompt (H2O's accumulated attention), in query chunks to bound memory."""
    hq, n, _ = q.shape
    total = torch.zeros(hq, n, dtype=torch.float32, device=q.device)
    for a in range(0, n, chunk):
        b = min(a + chunk, n)
        total[:, :b] += attention_probs(q[:, a:b], k[:, :b]).sum(dim=1)
    return total


def top_per_head(scores: torch.Tensor, count: int) -> torch.Tensor:
    """The ``count`` best columns of each row of ``scores`` ``[kv_heads, n]``, sorted by position."""
    return scores.topk(count, dim=-1).indices.sort(dim=-1).values


def budget(ratio: float, n: int, floor: int = 1) -> int:
    """Tokens kept of ``n`` at ``ratio``: ``ceil(ratio * n)``, at least ``floor``, at most ``n``."""
    return min(n, max(floor, math.ceil(ratio * n)))
