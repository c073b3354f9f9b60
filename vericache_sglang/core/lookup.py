"""Prompt-lookup drafts (n-gram copying, as SGLang's and vLLM's n-gram speculation propose them),
composed with compressed-KV drafts.

When the last tokens recur in the committed context (the prompt, a shared document, the output so
far), what followed them there is a proposal that costs no forward. Composition, at each draft
position where the compressed-KV model's prediction ``m`` is known:

- a lookup proposal ``L`` (the continuation of the longest recurring suffix, ``min_ngram`` to
  ``max_ngram`` tokens long) starts a chain when ``L[0] == m`` or the match is at least ``trust``
  tokens long (a long verbatim match outranks a model that lost the copied rows);
- the chain's tokens go through the model in one forward, which gives ``m`` at each of them; the
  chain ends at the first token the model disagrees with (unless trusted), and the model's token
  replaces it;
- where there is no proposal, the model drafts one token per forward as before.

So a chain costs one forward for up to ``max_tokens`` drafts, and copying that the compressed KV
cannot follow (the copied rows were dropped) is drafted from the token ids, which are all kept.
Verification is unchanged: output stays identical to full-KV decoding.

The lookup reads committed tokens only (drafts are not yet context): the same index serves the
engine and the acceptance estimator, which replays the policy along the full-KV trajectory.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class LookupParams:
    min_ngram: int = 2  # shortest suffix that may be looked up
    max_ngram: int = 4  # longest (tried first)
    max_tokens: int = 16  # longest chain proposed at once
    trust: int = 0  # a match this long is drafted even where the model disagrees (0: never)
    model: bool = True  # compressed-KV drafts where lookup has nothing (False: prompt lookup alone)

    def validate(self) -> None:
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"lookup: need 1 <= min_ngram <= max_ngram, got {self.min_ngram}, {self.max_ngram}")
        if self.max_tokens < 1:
            raise ValueError(f"lookup: max_tokens must be >= 1, got {self.max_tokens}")
        if self.trust < 0:
            raise ValueError(f"lookup: trust must be >= 0, got {self.trust}")

    @property
    def spec(self) -> str:
        return (
            f"lookup:min_ngram={self.min_ngram},max_ngram={self.max_ngram},max_tokens={self.max_tokens},"
            f"trust={self.trust},model={self.model}"
        )

    def trusted(self, match: int) -> bool:
        return self.trust > 0 and match >= self.trust


@dataclass(frozen=True)
class Proposal:
    tokens: list[int]  # the continuation (at least one token)
    match: int  # length of the suffix that recurred


@dataclass
class NgramIndex:
    """Where each n-gram (``min_ngram`` to ``max_ngram`` long) of a growing token list ended: the
    index just after each occurrence, increasing."""

    params: LookupParams
    tokens: list[int] = field(default_factory=list)
    _ends: dict[tuple[int, ...], list[int]] = field(default_factory=dict)

    def extend(self, tokens: Sequence[int]) -> None:
        lo, hi = self.params.min_ngram, self.params.max_ngram
        for t in tokens:
            self.tokens.append(int(t))
            end = len(self.tokens)
            for n in range(lo, min(hi, end) + 1):
                self._ends.setdefault(tuple(self.tokens[end - n : end]), []).append(end)

    def propose(self, history: Sequence[int], limit: int, k: int) -> Proposal | None:
        """The continuation of ``history``'s longest recurring suffix: up to ``k`` tokens of the
        first ``limit`` indexed ones, from the suffix's latest occurrence whose continuation starts
        before ``limit`` (so a suffix never proposes itself)."""
        if k < 1:
            return None
        limit = min(limit, len(self.tokens))
        for n in range(min(self.params.max_ngram, len(history)), self.params.min_ngram - 1, -1):
            ends = self._ends.get(tuple(int(t) for t in history[len(history) - n :]))
            if not ends:
                continue
            i = bisect.bisect_left(ends, limit) - 1
            if i >= 0:
                start = ends[i]
                return Proposal(self.tokens[start : min(start + k, limit)], n)
        return None
