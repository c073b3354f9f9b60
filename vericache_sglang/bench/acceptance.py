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
from vericache_sglang.core.lookup import LookupParams, NgramIndex, Proposal
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
        out = runner.forward(
            [Segment(g[:-1], list(range(p, p + len(g) - 1)), ctx, logits="none", keep_queries=len(g) - 1)]
        )[0]
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
            out = self.runner.forward(
                [Segment(g[c - 1 : c - 1 + n], list(range(p + c - 1, p + c - 1 + n)), DraftKV(self.ckv))]
            )[0]
            drafts = out.logits.argmax(dim=-1).tolist()
            self.cache[c] = next((j for j in range(n) if drafts[j] != g[c + j]), n)
        return self.cache[c]


def simulate(match: Callable[[int], int], n_tokens: int, horizon: int | Callable[[list[int], list[int]], int]) -> dict:
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
    return window_stats(drafted, accepted, committed)


def window_stats(drafted: list[int], accepted: list[int], committed: list[int]) -> dict:
    """The engine's statistics from its windows' drafted, accepted and committed tokens."""
    return {
        "windows": len(committed),
        "drafted": sum(drafted),
        "accepted": sum(accepted),
        "mean_accepted_length": sum(committed) / len(committed) if committed else 0.0,
        "acceptance_rate": sum(accepted) / sum(drafted) if sum(drafted) else 0.0,
        "committed": committed,
        "horizons": drafted,
    }


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
        step = runner.forward([Segment([traj.tokens[t]], [p + t], DraftKV(ckv), logits="last", keep_queries=keep)])[0]
        compressor.commit(ckv, step.kv, torch.tensor([p + t]), step.queries)
        full = traj.logits[t + 1].float().log_softmax(-1)
        lossy = step.logits[0].float().log_softmax(-1)
        out.append(float((full.exp() * (full - lossy)).sum()))
    return out


@dataclass
class WindowReplay:
    """One window replayed along the trajectory: what the engine would draft and accept."""

    accepted: int
    drafted: int
    forwards: int  # draft forwards (past the first mismatch: as if the drafts had matched)
    lookup_drafted: int
    lookup_accepted: int


@dataclass
class Miss:
    """A window's first wrong draft: where, and how close full-KV decoding's choice was there."""

    step: int  # index in the trajectory of the token drafted wrong
    truth: int  # full-KV decoding's token there
    drafted: int  # the compressed KV's argmax there (teacher-forced)
    full_margin: float  # full-KV logits: top-1 minus top-2 (a near tie when small)
    draft_margin: float  # draft logits: the drafted token's minus the truth's


def replay_window(
    truth: list[int],
    model: list[int] | None,
    propose: Callable[[int, int], Proposal | None],
    x: int,
    lookup: LookupParams | None,
) -> WindowReplay:
    """The drafting policy of ``engine/request.py`` over one window of horizon ``x``: ``truth[j]``
    is the trajectory's token at draft ``j``, ``model[j]`` the compressed KV's prediction there
    (teacher-forced; None: prompt lookup alone), ``propose(j, room)`` the lookup at draft ``j``."""
    drafts: list[tuple[int, str]] = []
    forwards = 0 if model is None else 1  # the window's first forward feeds the committed token
    j = 0
    while j < x:
        prop = propose(j, min(lookup.max_tokens, x - j)) if lookup is not None else None
        if model is None:
            if prop is None:
                break
            chain, trusted = prop.tokens, True
        elif prop is not None and (prop.tokens[0] == model[j] or lookup.trusted(prop.match)):
            chain, trusted = prop.tokens, lookup.trusted(prop.match)
        else:
            chain, trusted = None, False
        if chain is None:
            drafts.append((model[j], "model"))
            j += 1
            forwards += j < x
            continue
        for i, token in enumerate(chain):
            if i and not trusted and token != model[j + i]:  # the model's token; the chain ends
                drafts.append((model[j + i], "model"))
                j += i + 1
                forwards += j < x
                break
            drafts.append((token, "lookup"))
        else:
            j += len(chain)
            forwards += model is not None and (j < x or (len(chain) > 1 and not trusted))
    accepted = next((i for i, (t, _) in enumerate(drafts) if t != truth[i]), len(drafts))
    return WindowReplay(
        accepted,
        len(drafts),
        forwards,
        sum(s == "lookup" for _, s in drafts),
        sum(s == "lookup" for _, s in drafts[:accepted]),
    )


def replay(
    runner: ModelRunner,
    pre: Prefill,
    traj: Trajectory,
    compressor: Compressor,
    horizon: int,
    n_tokens: int | None = None,
    misses: list[Miss] | None = None,
) -> dict:
    """Windows of a static horizon along the trajectory, as the engine runs them, for the drafting
    that depends on where windows fall: verification-guided refresh (rows re-chosen by each
    verification's committed queries) and prompt lookup (the index holds the committed tokens).
    The compressed KV is folded and refreshed window by window exactly as the engine does.
    ``misses``, when given, collects each window's first wrong draft where the model drafted it."""
    g, p = traj.tokens, len(pre.tokens)
    n = len(g) if n_tokens is None else n_tokens
    lookup = compressor.lookup
    model = lookup is None or lookup.model
    ckv = compressor.compress(pre.kv, pre.obs)
    compressed_bytes = ckv.nbytes  # the prompt's, before any output is folded in
    index = NgramIndex(lookup) if lookup is not None else None
    if index is not None:
        index.extend([*pre.tokens, g[0]])
    keep_q = compressor.update_queries
    history = [*pre.tokens, *g]
    c, windows = 1, []
    while c < n:
        x = max(0, min(horizon, n - c - 1))
        predicted = None
        if model and x:
            out = runner.forward([Segment(g[c - 1 : c - 1 + x], list(range(p + c - 1, p + c - 1 + x)), DraftKV(ckv))])[
                0
            ]
            predicted = out.logits.argmax(dim=-1).tolist()

        def propose(j: int, room: int, c: int = c) -> Proposal | None:
            tail = history[max(0, p + c + j - lookup.max_ngram) : p + c + j]
            return index.propose(tail, p + c, room)

        w = replay_window(g[c : c + x], predicted, propose, x, lookup)
        windows.append(w)
        i, j = w.accepted, c + w.accepted  # the first wrong draft, when the model's (not a lookup chain's)
        if misses is not None and predicted is not None and i < x and predicted[i] != g[j]:
            top, row = traj.logits[j].float().topk(2).values, out.logits[i].float()
            misses.append(Miss(j, g[j], predicted[i], float(top[0] - top[1]), float(row[predicted[i]] - row[g[j]])))
        t = w.accepted + 1  # the committed tokens; their inputs g[c-1 .. c+t-2] become exact
        a, b = c - 1, c - 1 + t
        exact = [(k[:, a:b], v[:, a:b]) for k, v in traj.kv]
        queries = [q[:, a:b] for q in traj.queries] if keep_q else None
        compressor.commit(ckv, exact, torch.arange(p + a, p + b), queries)
        if compressor.refreshes:
            full = [
                [(pk, pv), (k[:, :a], v[:, :a]), (k[:, a:b], v[:, a:b])]
                for (pk, pv), (k, v) in zip(pre.kv.layers, traj.kv, strict=True)
            ]
            compressor.refresh(ckv, full, queries)
        if index is not None:
            index.extend(g[c : c + t])
        c += t
    stats = window_stats([w.drafted for w in windows], [w.accepted for w in windows], [w.accepted + 1 for w in windows])
    return {
        **stats,
        "forwards": [w.forwards for w in windows],
        "compressed_kv_bytes": compressed_bytes,
        "lookup_drafted": sum(w.lookup_drafted for w in windows),
        "lookup_accepted": sum(w.lookup_accepted for w in windows),
    }
