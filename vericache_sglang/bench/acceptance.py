"""Acceptance without running VeriCache for every cell: a teacher-forced estimator.

Along the full-KV greedy trajectory ``g`` (which VeriCache reproduces exactly), the compressed KV
at a window start ``c`` holds the prompt and the exact K/V of ``g[:c-1]`` folded in, whatever
windows came before (droppers fold token by token; quantizers flush by count). So one forward of
``g[c-1 : c-1+64]`` over it, teacher-forced, gives how many drafts from ``c`` match: ``match(c)``.
A static horizon ``x`` then commits ``min(match(c), x) + 1`` tokens per verification, from
``c = 1`` on, exactly as the engine would (Quest's page choice is the one approximation: a window
picks pages for all its queries at once, drafting picks them step by step).

The same trajectory gives Figure 4 of the paper: the KL divergence of lossy decoding (compressed
KV alone, its own K/V folded in) from full-KV decoding at each step along ``g``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from vericache_sglang.core.compress import Compressor
from vericache_sglang.core.horizon import WindowCost
from vericache_sglang.engine.generation import GenerationResult, Prefill
from vericache_sglang.engine.runner import DraftKV, ModelRunner, ResidentKV, Segment

MAX_WINDOW = 64


@dataclass
class Trajectory:
    """The full-KV greedy continuation and what folding it needs: exact K/V and queries."""

    tokens: list[int]  # g_0 .. g_{N-1}
    logits: list[torch.Tensor]  # the full-KV logits that chose each g_t
    kv: list[tuple[torch.Tensor, torch.Tensor]]  # per layer, K/V of g_0 .. g_{N-2}
    queries: list[torch.Tensor]  # per layer, their queries

    @classmethod
    def of(cls, runner: ModelRunner, pre: Prefill, reference: GenerationResult) -> Trajectory:
        if reference.logits is None:
            raise ValueError("the reference needs keep_logits=True")
        g, p = reference.tokens, len(pre.tokens)
        ctx = ResidentKV.from_full(pre.kv, p + len(g))
        out = runner.forward([Segment(g[:-1], list(range(p, p + len(g) - 1)), ctx, logits="none",
                                      keep_queries=len(g) - 1)])[0]
        return cls(list(g), list(reference.logits), out.kv, out.queries)


@dataclass
class MatchLengths:
    """``match(c)`` for one compressor, computed on demand for increasing ``c``."""

    runner: ModelRunner
    pre: Prefill
    traj: Trajectory
    compressor: Compressor
    cache: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.ckv = self.compressor.compress(self.pre.kv, self.pre.obs)
        self.folded = 0  # generated tokens whose exact K/V is in ckv

    def _fold_upto(self, n: int) -> None:
        if n <= self.folded:
            return
        a, b, p = self.folded, n, len(self.pre.tokens)
        kv = [(k[:, a:b], v[:, a:b]) for k, v in self.traj.kv]
        queries = [q[:, a:b] for q in self.traj.queries]
        self.compressor.commit(self.ckv, kv, torch.arange(p + a, p + b), queries)
        self.folded = n

    def __call__(self, c: int) -> int:
        if c not in self.cache:
            if c - 1 < self.folded:  # folding cannot go back: start again from the prompt
                self.ckv = self.compressor.compress(self.pre.kv, self.pre.obs)
                self.folded = 0
            g, p = self.traj.tokens, len(self.pre.tokens)
            self._fold_upto(c - 1)
            n = min(MAX_WINDOW, len(g) - c)
            out = self.runner.forward([Segment(g[c - 1 : c - 1 + n], list(range(p + c - 1, p + c - 1 + n)),
                                               DraftKV(self.ckv))])[0]
            drafts = out.logits.argmax(dim=-1).tolist()
            self.cache[c] = next((j for j in range(n) if drafts[j] != g[c + j]), n)
        return self.cache[c]


def simulate(match: Callable[[int], int], n_tokens: int,
             horizon: int | Callable[[list[int], list[int]], int]) -> dict:
    """Windows of a static horizon (or a policy: drafted and accepted so far -> next horizon) along
    a trajectory of ``n_tokens``: the engine's statistics, from ``match``."""
    c, drafted, accepted, committed = 1, [], [], []
    while c < n_tokens:
        x = horizon if isinstance(horizon, int) else horizon(drafted, accepted)
        x = min(x, n_tokens - c)
        a = min(match(c), x)
        drafted.append(x)
        accepted.append(a)
        committed.append(min(a + 1, n_tokens - c))
        c += committed[-1]
    return {"windows": len(committed), "drafted": sum(drafted), "accepted": sum(accepted),
            "mean_accepted_length": sum(committed) / len(committed) if committed else 0.0,
            "acceptance_rate": sum(accepted) / sum(drafted) if drafted else 0.0, "committed": committed,
            "horizons": drafted}


def throughput(stats: dict, cost: WindowCost) -> float:
    """Committed tokens per unit time under ``cost`` (the unit is the cost's)."""
    time = sum(cost.window_s(x) for x in stats["horizons"])
    return sum(stats["committed"]) / time if time else 0.0


def all_horizons(match: MatchLengths, n_tokens: int, horizons: list[int]) -> dict[int, dict]:
    """Every static horizon's statistics. The horizons advance together, the one furthest behind
    first, so ``match`` is asked for window starts in increasing order (folding cannot go back)."""
    at = {x: 1 for x in horizons}
    while True:
        behind = [x for x in horizons if at[x] < n_tokens]
        if not behind:
            break
        x = min(behind, key=lambda h: at[h])
        c = at[x]
        at[x] = c + min(min(match(c), x, n_tokens - c) + 1, n_tokens - c)
    return {x: simulate(match, n_tokens, x) for x in horizons}


def kl_curve(runner: ModelRunner, pre: Prefill, traj: Trajectory, compressor: Compressor) -> list[float]:
    """KL(full || lossy) of the next-token distribution at each step along the trajectory, lossy
    decoding folding its own (inexact) K/V, as it would when decoding alone."""
    ckv = compressor.compress(pre.kv, pre.obs)
    p, out = len(pre.tokens), [0.0]  # step 0 comes from the shared exact prefill
    keep = int(compressor.update_queries)
    for t in range(len(traj.tokens) - 1):
        step = runner.forward([Segment([traj.tokens[t]], [p + t], DraftKV(ckv), logits="last",
                                       keep_queries=keep)])[0]
        compressor.commit(ckv, step.kv, torch.tensor([p + t]), step.queries)
        full = traj.logits[t + 1].float().log_softmax(-1)
        lossy = step.logits[0].float().log_softmax(-1)
        out.append(float((full.exp() * (full - lossy)).sum()))
    return out
