"""One draft window: the compressed KV's model composed with prompt-lookup chains (``lookup.py``).

Engine-independent: the reference and batch engines (``engine/request.py``) and the SGLang worker
drive the same object, so where a window drafts what is decided once. A caller loops

    while window.drafting:
        rows = forward(window.pending)        # one forward: the inputs the window's KV lacks
        window.take(rows)                     # their next-token logits (all rows for a chain)

and verifies ``window.drafts``. ``pending`` is one token (the committed seed, then the model's
last draft) or a lookup chain, whose every row the model checks in that one forward: where it
disagrees the chain is cut (the caller's ``forget`` drops the cut tokens' K/V) and the model's
token drafted instead. Each draft's source ("model" or "lookup") is kept for the statistics.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from vericache_sglang.core.lookup import LookupParams, NgramIndex, Proposal
from vericache_sglang.core.sampling import STREAM_DRAFT, Sampler


class Grammar(Protocol):
    """The constraint state a window drafts under (``engine/constraint.py: ConstraintState``)."""

    def mask(self) -> torch.Tensor: ...
    def allows(self, token: int, mask: torch.Tensor) -> bool: ...
    def apply(self, logits: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor: ...
    def advance(self, token: int) -> bool: ...
    def rollback(self, n: int) -> None: ...


class DraftWindow:
    """``x`` drafts after ``base_position`` committed tokens (the last of them, ``unfed``'s last,
    has no K/V in the window yet). ``index`` holds the committed tokens (lookup only);
    ``forget(n)`` drops the window KV's last ``n`` tokens; ``grammar``, when given, is walked along
    the drafts (the caller rolls it back by ``grammar_walked`` after verification)."""

    def __init__(
        self,
        x: int,
        base_position: int,
        unfed: Sequence[int],
        sampler: Sampler,
        rejection: bool,
        eos_ids: Sequence[int],
        vocab_size: int,
        forget: Callable[[int], None],
        lookup: LookupParams | None = None,
        index: NgramIndex | None = None,
        grammar: Grammar | None = None,
        device: torch.device | str = "cpu",
    ):
        if lookup is not None and index is None:
            raise ValueError("a lookup window needs the committed tokens' n-gram index")
        self.x, self.base = x, base_position
        self.sampler, self.rejection = sampler, rejection
        self.eos_ids, self.vocab_size, self.forget = set(eos_ids), vocab_size, forget
        self.lookup, self.index, self.grammar, self.device = lookup, index, grammar, device
        self.drafts: list[int] = []
        self.draft_probs: list[torch.Tensor | None] = []  # rejection sampling: each draft's distribution
        self.draft_masks: list[torch.Tensor | None] = []  # with a grammar: its mask before each draft
        self.sources: list[str] = []  # each draft's source: "model" or "lookup"
        self.grammar_walked = 0  # drafts the grammar took
        self.grammar_halted = False  # a draft it could not take: drafting stops there
        self.pending: list[int] = list(unfed)  # inputs the window's KV lacks
        self._chain = self._chain_match = 0  # a lookup chain at the end of the drafts, unchecked
        if lookup is not None and not lookup.model:  # prompt lookup alone: no forward
            while len(self.drafts) < x and self._push_chain(self._propose(), trusted=True):
                pass
            self.pending = []

    @property
    def drafting(self) -> bool:
        """Whether the window needs another forward."""
        if not self.pending or self.grammar_halted:
            return False
        if self._chain > 1 and not self.lookup.trusted(self._chain_match):
            return True  # the model checks the chain, so the drafts are the model's own
        return self._room_to_draft()

    @property
    def chain(self) -> bool:
        """Whether ``pending`` is a lookup chain (the forward must return every row's logits)."""
        return self._chain > 0

    @property
    def position(self) -> int:
        """The true position of ``pending``'s first token."""
        return self.base + len(self.drafts) - len(self.pending)

    def take(self, rows: torch.Tensor) -> None:
        """The forward of ``pending`` gave ``rows`` ``[len(pending), vocab]`` (a chain) or its last
        row ``[1, vocab]``: check the chain, then draft the next token."""
        if self._chain:
            first = len(self.drafts) - self._chain  # the chain's first draft (checked when proposed)
            trusted = self.lookup.trusted(self._chain_match)
            for i in range(1, self._chain):  # draft first + i, predicted by the chain's row i - 1
                idx = first + i
                token, probs, mask = self._choose(rows[i - 1 : i], idx)
                if token == self.drafts[idx] or trusted:
                    if not trusted and self.rejection:  # drafted iff the model drew it: its distribution
                        self.draft_probs[idx] = probs
                    continue
                self._pop(len(self.drafts) - idx)  # the model disagrees: its token from here
                self.forget(self._chain - i)
                self._push(token, probs, mask, "model")
                self.pending, self._chain = [token], 0
                return
        self.pending, self._chain = [], 0
        if self._room_to_draft():
            self._decide(rows[-1:])

    def _room_to_draft(self) -> bool:
        """Under the horizon, not past an end, nor past a draft the grammar could not take."""
        eos = self.drafts and self.drafts[-1] in self.eos_ids  # nothing after an end is committed
        return len(self.drafts) < self.x and not eos and not self.grammar_halted

    def _decide(self, logits: torch.Tensor) -> None:
        """The next draft, the model's next-token logits known: a lookup chain where the lookup
        agrees with the model's token (or its match is trusted), else the model's token."""
        token, probs, mask = self._choose(logits, len(self.drafts))
        proposal = self._propose()
        trusted = proposal is not None and self.lookup.trusted(proposal.match)
        if proposal is not None and (proposal.tokens[0] == token or trusted):
            if self._push_chain(proposal, trusted, None if trusted else probs):
                return
        self._push(token, probs, mask, "model")
        self.pending = [token]

    def _propose(self) -> Proposal | None:
        if self.lookup is None:
            return None
        tail = self.lookup.max_ngram
        history = (self.index.tokens[-tail:] + self.drafts)[-tail:]
        room = min(self.lookup.max_tokens, self.x - len(self.drafts))
        return self.index.propose(history, len(self.index.tokens), room)

    def _push_chain(self, proposal: Proposal | None, trusted: bool, first_probs: torch.Tensor | None = None) -> int:
        """Draft a lookup chain (as far as a grammar allows it); returns how many were drafted."""
        if proposal is None:
            return 0
        pushed = 0
        for token in proposal.tokens[: self.x - len(self.drafts)]:
            mask = None
            if self.grammar is not None:
                mask = self.grammar.mask()
                if not self.grammar.allows(token, mask):
                    break  # the grammar does not allow it: the chain stops before it
            probs = None
            if self.rejection:  # drafted for certain (trusted, or unchecked at the window's end)
                probs = first_probs if pushed == 0 and first_probs is not None else self._onehot(token)
            self._push(token, probs, mask, "lookup")
            pushed += 1
            if self.grammar_halted or token in self.eos_ids:
                break
        if pushed:
            self.pending, self._chain, self._chain_match = list(self.drafts[-pushed:]), pushed, proposal.match
        return pushed

    def _onehot(self, token: int) -> torch.Tensor:
        probs = torch.zeros(self.vocab_size, device=self.device)
        probs[token] = 1.0
        return probs

    def _choose(self, logits: torch.Tensor, idx: int) -> tuple[int, torch.Tensor | None, torch.Tensor | None]:
        """The model's draft at draft index ``idx`` from its logits ``[1, vocab]``: the token, its
        distribution (rejection sampling) and the grammar's mask there."""
        pos = self.base + idx  # the drafted token's position
        mask = None
        if self.grammar is not None:
            mask = self.draft_masks[idx] if idx < len(self.draft_masks) else self.grammar.mask()
            logits = self.grammar.apply(logits, mask)
        if self.rejection:
            return int(self.sampler.sample(logits, [pos], STREAM_DRAFT)[0]), self.sampler.probs(logits)[0], mask
        return int(self.sampler.sample(logits, [pos])[0]), None, mask

    def _push(self, token: int, probs: torch.Tensor | None, mask: torch.Tensor | None, source: str) -> None:
        self.drafts.append(token)
        self.sources.append(source)
        if self.rejection:
            self.draft_probs.append(probs)
        if self.grammar is not None:
            self.draft_masks.append(mask)
            if self.grammar.advance(token):
                self.grammar_walked += 1
            else:  # complete, or the draft is not in it: nothing after it can be verified as drafted
                self.grammar_halted = True

    def _pop(self, n: int) -> None:
        """Take back the last ``n`` drafts (and the grammar's steps along them)."""
        if not n:
            return
        if self.grammar is not None:
            walked = n - 1 if self.grammar_halted else n  # only the last draft can have halted it
            self.grammar.rollback(walked)
            self.grammar_walked -= walked
            self.grammar_halted = False
            del self.draft_masks[-n:]
        if self.rejection:
            del self.draft_probs[-n:]
        del self.drafts[-n:], self.sources[-n:]
