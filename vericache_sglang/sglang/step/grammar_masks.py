"""A grammar's token masks along a drafted chain, from SGLang's own grammar object (xgrammar).

Constrained decoding picks each token from the logits masked by the grammar's state after the
tokens before it. Along a chain of drafts that state is the committed state advanced over the
drafts so far, so one walk gives every position's mask: fill the mask for position ``j``, draft
the ``j``-th token from masked draft logits, advance the matcher over it; after the last draft the
bonus position's mask. The matcher is then rolled back to the committed state (SGLang's scheduler
advances it over the tokens this step commits), and verification applies the same masks to the
full-KV logits at the same positions: what VeriCache commits is what full-KV constrained decoding
chooses, token for token. Once the matcher terminates (the grammar is complete) the chain's later
positions are left unmasked: SGLang's scheduler ends the request there and drops what follows.

A lookup window (``+lookup``) walks the grammar itself, through ``WindowGrammar`` (the core
``DraftWindow``'s grammar over SGLang's object): it records each draft's mask and rolls back the
chains the model cuts; ``ChainMasks.adopt`` then takes the window's masks for verification.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING

import torch

from vericache_sglang.engine.constraint import ConstraintState

if TYPE_CHECKING:
    from sglang.srt.constrained.base_grammar_backend import BaseGrammarObject

    from vericache_sglang.core.drafting import DraftWindow


class ChainMasks:
    def __init__(self, grammars: dict[int, BaseGrammarObject], width: int, vocab: int, device: torch.device | str):
        """``grammars``: batch index -> the request's SGLang grammar object."""
        self.grammars = grammars
        self.masks = {i: g.allocate_vocab_mask(vocab, width, device) for i, g in grammars.items()}
        self.advanced = dict.fromkeys(grammars, 0)  # tokens the matcher took this step
        self.following = dict.fromkeys(grammars, True)  # still in step with the chain
        self.filled = dict.fromkeys(grammars, 0)  # positions whose mask is set

    def __bool__(self) -> bool:
        return bool(self.grammars)

    def fill(self, j: int, rows: list[int] | None = None) -> None:
        """Set position ``j``'s mask (the matcher's state after ``j`` drafts) for ``rows`` (all by default)."""
        for i in self.grammars if rows is None else rows:
            if i in self.grammars and self.following[i] and self.filled[i] == j:
                if self.grammars[i].is_terminated():
                    self.following[i] = False
                    continue
                self.grammars[i].fill_vocab_mask(self.masks[i], j)
                self.filled[i] = j + 1

    def apply(self, logits: torch.Tensor, j: int, rows: list[int]) -> None:
        """Mask ``logits`` ``[len(rows), vocab]`` (row ``r`` is batch index ``rows[r]``) at position ``j``, in place."""
        for r, i in enumerate(rows):
            if i in self.grammars and self.filled[i] > j:
                self.grammars[i].apply_vocab_mask(logits[r : r + 1], self.masks[i][j : j + 1].to(logits.device))

    def advance(self, i: int, token: int) -> None:
        """The matcher of batch index ``i`` takes its draft ``token``."""
        if i not in self.grammars or not self.following[i]:
            return
        if not accept(self.grammars[i], token):  # complete; or a fully masked row's token
            self.following[i] = False
            return
        self.advanced[i] += 1

    def restore(self) -> None:
        """Back to the committed state (before any draft of this step)."""
        for i, grammar in self.grammars.items():
            if self.advanced[i]:
                grammar.rollback(self.advanced[i])
            self.advanced[i] = 0

    def adopt(self, i: int, window: DraftWindow) -> None:
        """Batch index ``i`` drafted in a lookup ``window`` walking its grammar (a ``WindowGrammar``):
        its drafts' masks, then the bonus position's (the state after them), are the verification's;
        the walk is undone by ``restore`` like a chain's."""
        masks = list(window.draft_masks)
        if not window.grammar_halted and not self.grammars[i].is_terminated():
            masks.append(window.grammar.mask())
        for j, mask in enumerate(masks):
            self.masks[i][j : j + 1] = mask
        self.filled[i], self.advanced[i] = len(masks), window.grammar_walked

    def apply_chain(self, i: int, logits: torch.Tensor) -> None:
        """Mask batch index ``i``'s verification logits ``[width, vocab]`` where it has masks, in place."""
        n = self.filled.get(i, 0)
        if n:
            self.grammars[i].apply_vocab_mask(logits[:n], self.masks[i][:n].to(logits.device))

    def apply_chains(self, logits: torch.Tensor, done: Collection[int] = ()) -> None:
        """Mask the verification logits ``[bs, width, vocab]`` at every position that has a mask,
        but not the rows in ``done`` (masked already, where they were decided)."""
        for i in self.grammars:
            if i not in done:
                self.apply_chain(i, logits[i])


class WindowGrammar:
    """SGLang's grammar object as the core ``DraftWindow``'s ``Grammar``: masks as xgrammar
    bitmasks ``[1, words]``; a terminated grammar masks nothing (as ``ChainMasks`` leaves it)."""

    def __init__(self, grammar: BaseGrammarObject, vocab: int, device: torch.device | str):
        self.grammar, self.vocab, self.device = grammar, vocab, device

    def mask(self) -> torch.Tensor:
        mask = self.grammar.allocate_vocab_mask(self.vocab, 1, self.device)
        if self.grammar.is_terminated():
            return mask.fill_(-1)  # every bit set
        self.grammar.fill_vocab_mask(mask, 0)
        return mask

    allows = staticmethod(ConstraintState.allows)  # the same xgrammar bitmask layout

    def apply(self, logits: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        out = logits.float().clone()
        mask = self.mask() if mask is None else mask
        self.grammar.apply_vocab_mask(out, mask.expand(out.shape[0], -1).contiguous().to(out.device))
        return out

    def advance(self, token: int) -> bool:
        return accept(self.grammar, token)

    def rollback(self, n: int) -> None:
        if n:
            self.grammar.rollback(n)


def accept(grammar: BaseGrammarObject, token: int) -> bool:
    """SGLang's grammar object takes ``token``; False (nothing changed) when it is complete or
    forbids the token (its ``accept_token`` raises ``ValueError`` then)."""
    if grammar.is_terminated():
        return False
    try:
        grammar.accept_token(int(token))
    except ValueError:
        return False
    return True
