"""Acceptance: which drafted tokens a verification commits. Pure functions over tokens and probs."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, get_args

import torch

from vericache_sglang.core.sampling import STREAM_ACCEPT, STREAM_RESIDUAL, STREAM_TOKEN, Sampler

# How a chain is verified: "exact" (greedy, or the position-keyed sampler: the tokens full-KV
# decoding gives) or "rejection" (speculative rejection sampling: the same distribution, not the
# same tokens). The engine's ``--verify`` and SGLang's ``verification`` take these names.
Verification = Literal["exact", "rejection"]
VERIFICATIONS: tuple[str, ...] = get_args(Verification)


@dataclass(frozen=True)
class Verdict:
    accepted: int  # drafted tokens accepted
    tokens: list[int]  # committed: the accepted drafts, then the verifier's correction or bonus token


def greedy_accept(draft: Sequence[int], target: Sequence[int]) -> Verdict:
    """Accept the longest prefix of ``draft`` that agrees with ``target``, then the verifier's token.

    ``target[i]`` is the verifier's token at draft position ``i``; ``target`` has one more entry
    than ``draft`` (the bonus after the last drafted token). Used for greedy decoding and for
    seeded sampling, where both sides draw with the same position-keyed noise.
    """
    if len(target) != len(draft) + 1:
        raise ValueError(f"{len(draft)} drafted tokens need {len(draft) + 1} verifier tokens, got {len(target)}")
    n = 0
    while n < len(draft) and int(draft[n]) == int(target[n]):
        n += 1
    return Verdict(n, [int(t) for t in draft[:n]] + [int(target[n])])


def rejection_accept(
    draft: Sequence[int],
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    positions: Sequence[int],
    sampler: Sampler,
) -> Verdict:
    """Speculative rejection sampling (Leviathan et al., Chen et al.): lossless in distribution.

    ``draft_probs`` ``[x, vocab]`` is the drafter's distribution at each drafted position,
    ``target_probs`` ``[x + 1, vocab]`` the verifier's; ``positions[i]`` is draft ``i``'s position
    (``x + 1`` entries). Coins and residual draws are keyed by (seed, position) like every draw.
    """
    x = len(draft)
    for i in range(x):
        d = int(draft[i])
        p, q = float(target_probs[i, d]), float(draft_probs[i, d])
        if sampler.uniform(positions[i], STREAM_ACCEPT) * q < p:
            continue
        residual = (target_probs[i].float() - draft_probs[i].float()).clamp_(min=0)
        total = float(residual.sum())
        # q >= p everywhere only if they are equal, where rejection has probability zero.
        dist = residual / total if total > 0 else target_probs[i].float()
        return Verdict(i, [int(t) for t in draft[:i]] + [sampler.sample_probs(dist, positions[i], STREAM_RESIDUAL)])
    bonus = sampler.sample_probs(target_probs[x].float(), positions[x], STREAM_TOKEN)
    return Verdict(x, [int(t) for t in draft] + [bonus])
