"""Expected Attention (Devoto et al., 2025, kvpress): score each key by the attention that future
queries are expected to pay it, modelling those queries as a Gaussian fitted to the prompt's
pre-RoPE queries and rotated by the RoPE averaged over the next ``n_future`` positions:
``E[A] ∝ exp(k·mu / sqrt(d) + k^T Sigma k / 2d)``, softmaxed over the keys, averaged over each KV
head's query group, then scaled by the value norm. The first ``n_sink`` tokens are always kept
and left out of the statistics. Tokens committed later are appended."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from vericache_sglang.core.compress.base import DroppedLayer, KeepingDropper, check_ratio
from vericache_sglang.core.compress.drop.scoring import budget, per_kv_head, top_per_head
from vericache_sglang.core.compress.observation import Observation
from vericache_sglang.core.compress.rope import Rope


@dataclass
class ExpectedAttentionParams:
    """Expected Attention (Devoto et al. 2025, arXiv:2510.00636; NVIDIA kvpress's ExpectedAttentionPress).

    Parameters
    ----------
    ratio : float
        Tokens each KV head keeps, as a fraction of the prompt's ``n`` tokens: ``ceil(ratio * n)``, at
        least ``n_sink`` (sinks included). In (0, 1]. kvpress's ``compression_ratio`` is ``1 - ratio``.
    n_future : int
        Future positions, in tokens, whose RoPE rotations are averaged (positions ``n .. n + n_future - 1``)
        to rotate the prompt queries' mean and covariance. >= 1. kvpress's ``n_future_positions``.
    n_sink : int
        First prompt tokens, always kept and left out of the query statistics and the scoring. >= 0.
    covariance : bool
        Add the covariance term ``k^T Sigma k / 2d`` to the logits (else the mean's alone). kvpress's
        ``use_covariance``.
    vnorm : bool
        Scale each score by its value's L2 norm: ``(score + epsilon) * ||v||``. kvpress's ``use_vnorm``.
    epsilon : float
        Added to the scores before the value-norm scaling; used only with ``vnorm``, not validated.
    """

    ratio: float = 0.25
    n_future: int = 512
    n_sink: int = 4
    covariance: bool = True
    vnorm: bool = True
    epsilon: float = 0.0


def averaged_rotation(rope: Rope, start: int, count: int, head_dim: int) -> torch.Tensor:
    """The mean over positions ``start .. start + count - 1`` of RoPE's rotation matrix."""
    cos, sin = rope.cos_sin(torch.arange(start, start + count))
    half = head_dim // 2
    p = torch.zeros(head_dim, head_dim)
    p[half:, :half] = torch.eye(half)
    p[:half, half:] = -torch.eye(half)
    return (cos.unsqueeze(-1) * torch.eye(head_dim) + sin.unsqueeze(-1) * p).mean(dim=0)


class ExpectedAttention(KeepingDropper):
    name = "expected_attention"
    Params = ExpectedAttentionParams
    summary = "attention expected from future queries (prompt query statistics, averaged RoPE)"
    needs = frozenset({"prompt", "rope"})

    def validate(self) -> None:
        p = self.params
        check_ratio("expected_attention", p.ratio)
        if p.n_future < 1 or p.n_sink < 0:
            raise ValueError(f"expected_attention: n_future must be >= 1 and n_sink >= 0, got {p.n_future}, {p.n_sink}")

    def compress_layer(self, layer_idx, k, v, obs: Observation | None) -> DroppedLayer:
        p = self.params
        hk, n, d = k.shape
        count = budget(p.ratio, n, floor=min(n, p.n_sink))
        if count >= n or n <= p.n_sink + 1:
            return DroppedLayer.gather(k, v, torch.arange(n, device=k.device).expand(hk, -1))
        source = (obs or Observation()).model("expected_attention")
        rope = source.rope()
        q = source.prompt_queries()[layer_idx].float()  # post-RoPE, [hq, n, d]
        q = rope.unrotate(q, torch.arange(n, device=q.device))[:, p.n_sink :]
        mu = q.mean(dim=1)  # [hq, d]
        r = averaged_rotation(rope, n, p.n_future, d).to(q.device)
        mu = mu @ r.T
        keys = k[:, p.n_sink :].float().repeat_interleave(q.shape[0] // hk, dim=0)  # [hq, n - s, d]
        logits = keys @ mu.unsqueeze(-1) / math.sqrt(d)
        logits = logits.squeeze(-1)
        if p.covariance:
            centered = q - q.mean(dim=1, keepdim=True)
            cov = r @ (centered.transpose(1, 2) @ centered / q.shape[1]) @ r.T  # [hq, d, d]
            logits += torch.einsum("hnd,hde,hne->hn", keys, cov, keys) / d / 2
        scores = per_kv_head(logits.softmax(dim=-1), hk)
        if p.vnorm:
            scores = (scores + p.epsilon) * torch.linalg.vector_norm(v[:, p.n_sink :].float(), dim=-1)
        sinks = torch.full((hk, p.n_sink), float("inf"), device=k.device)
        return DroppedLayer.gather(k, v, top_per_head(torch.cat([sinks, scores], dim=1), count))
