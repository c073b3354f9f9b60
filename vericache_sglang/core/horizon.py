"""Adaptive draft horizon (the paper keeps ``x`` static and names per-request adaptation as future
work): pick the next window's length from the acceptance seen so far and what a window costs.

Acceptance model: each draft is accepted with probability ``alpha`` until the first rejection
(geometric), so a window of ``x`` commits ``E(x) = 1 + alpha + ... + alpha^x`` tokens (accepted
drafts plus the verifier's own). ``alpha`` is the censored maximum-likelihood estimate over the
request's recent windows, accepts over accepts-plus-rejections (a window that accepted all drafts
had no rejection), with a small prior so the first window is not a guess.

Cost model: drafting ``x`` steps overlaps the full-KV reload, then the verify pass runs:
``T(x) = max(x * draft_s, transfer_s) + verify_s``, with ``transfer_s`` the reload's bytes over the
link's bandwidth. The policy takes the ``x`` in ``[1, max_horizon]`` with the most tokens per
second, ``E(x) / T(x)``: a slow link pushes it to draft longer (the reload is hidden anyway), low
acceptance pushes it shorter.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class WindowCost:
    draft_s: float  # one draft step
    verify_s: float  # one verify pass, compute only
    transfer_s: float  # the full-KV reload over the link, overlapped with drafting

    def window_s(self, x: int) -> float:
        return max(x * self.draft_s, self.transfer_s) + self.verify_s


def expected_committed(alpha: float, x: int) -> float:
    """Tokens a window of ``x`` drafts commits when each is accepted with probability ``alpha``."""
    if alpha >= 1.0:
        return float(x + 1)
    return (1.0 - alpha ** (x + 1)) / (1.0 - alpha)


@dataclass
class AdaptiveHorizon:
    max_horizon: int = 64
    prior_accepts: float = 4.0  # the prior: alpha = 0.8 worth five drafts
    prior_rejects: float = 1.0
    memory: float = 0.8  # weight of a window relative to the next one (recent windows count more)

    def __post_init__(self) -> None:
        if self.max_horizon < 1:
            raise ValueError(f"max_horizon must be >= 1, got {self.max_horizon}")
        if not 0.0 < self.memory <= 1.0:
            raise ValueError(f"memory must be in (0, 1], got {self.memory}")

    def acceptance(self, drafted: Sequence[int], accepted: Sequence[int]) -> float:
        accepts, rejects, w = self.prior_accepts, self.prior_rejects, 1.0
        for x, a in zip(reversed(drafted), reversed(accepted), strict=True):
            accepts += w * a
            rejects += w * (a < x)
            w *= self.memory
        return accepts / (accepts + rejects)

    def choose(self, drafted: Sequence[int], accepted: Sequence[int], cost: WindowCost) -> int:
        alpha = self.acceptance(drafted, accepted)
        return max(range(1, self.max_horizon + 1), key=lambda x: expected_committed(alpha, x) / cost.window_s(x))
