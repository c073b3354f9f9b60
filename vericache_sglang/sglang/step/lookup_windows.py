"""``+lookup`` in the worker: each request's n-gram index over its committed tokens, and the draft
loop that drives the core's ``DraftWindow`` (``core/drafting.py``) over the private pool.

A pass feeds every unfinished window its pending tokens at its next scratch slots: one token each
as a DECODE pass, or, where some window feeds a lookup chain, all of them as one TARGET_VERIFY pass
over the private pool (``ForwardBuilder.chain``). Shorter pending lists are padded: a pad writes
only its own request's later scratch slots, its logits are dropped, and causality keeps the real
rows clean. A chain the model cuts is forgotten: the next pass overwrites its slots. A request
with a grammar walks it in its window (``WindowGrammar``): chains stop where the grammar forbids a
token, and a cut chain's steps are rolled back.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING

import torch

from vericache_sglang.core.drafting import DraftWindow
from vericache_sglang.core.lookup import LookupParams, NgramIndex
from vericache_sglang.core.sampling import Sampler
from vericache_sglang.sglang.step.grammar_masks import WindowGrammar

if TYPE_CHECKING:
    from sglang.srt.constrained.base_grammar_backend import BaseGrammarObject
    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

    from vericache_sglang.sglang.draft.pool import CompressedDraftPool
    from vericache_sglang.sglang.step.forward import ForwardBuilder


class LookupWindows:
    def __init__(
        self,
        lookup: LookupParams,
        horizon: int,
        draft_pool: CompressedDraftPool,
        forwards: ForwardBuilder,
        vocab_size: int,
        rejection: bool,
        device: torch.device | str,
        decode_pass: Callable[[ForwardBatch], torch.Tensor],
        chain_pass: Callable[[ForwardBatch], torch.Tensor],
    ):
        """``decode_pass``/``chain_pass``: run a DECODE / TARGET_VERIFY ``ForwardBatch`` over the
        private pool and return its logits (one row per token)."""
        self.lookup, self.horizon = lookup, horizon
        self.draft_pool, self.forwards = draft_pool, forwards
        self.vocab_size, self.rejection, self.device = vocab_size, rejection, device
        self.decode_pass, self.chain_pass = decode_pass, chain_pass
        self.indexes: dict[str, NgramIndex] = {}  # rid -> its committed tokens' n-grams

    def __contains__(self, rid: str) -> bool:
        return rid in self.indexes

    def admit(self, rid: str, committed: Sequence[int]) -> None:
        """Index a request's committed tokens (prompt, earlier outputs, the first token last)."""
        self.indexes[rid] = NgramIndex(self.lookup)
        self.indexes[rid].extend(committed)

    def extend(self, rid: str, tokens: Sequence[int]) -> None:
        """A verification committed ``tokens`` (the last is the next seed); drafts never enter."""
        if rid in self.indexes:
            self.indexes[rid].extend(tokens)

    def forget(self, rid: str) -> None:
        self.indexes.pop(rid, None)

    def draft(
        self,
        batch: ScheduleBatch,
        rows: list[int],
        seeds: torch.Tensor,
        committed: torch.Tensor,
        samplers: list[Sampler],
        grammars: dict[int, BaseGrammarObject],
    ) -> tuple[list[DraftWindow], int]:
        """Draft the windows of the requests at batch indices ``rows`` (``grammars``: batch index ->
        SGLang's grammar object, walked along the drafts and left walked: the caller restores it);
        returns the windows and the passes run."""
        reqs = [batch.reqs[i] for i in rows]
        private = torch.tensor([self.draft_pool.row_index(r.rid) for r in reqs], dtype=torch.int64, device=self.device)
        kept = [self.draft_pool.kept_len(r.rid) for r in reqs]
        scratch = [self.draft_pool.scratch_slots(r.rid).to(self.device) for r in reqs]
        fed = [0] * len(rows)  # window tokens with K/V in each request's scratch

        def forget(r: int, n: int) -> None:
            fed[r] -= n

        windows = [
            DraftWindow(
                self.horizon,
                int(committed[i]) + 1,
                [int(seeds[i])],
                samplers[i],
                self.rejection,
                stop_ids(req),
                self.vocab_size,
                partial(forget, r),
                self.lookup,
                self.indexes[req.rid],
                grammar=self._walk(grammars.get(i)),
                device=self.device,
            )
            for r, (i, req) in enumerate(zip(rows, reqs, strict=True))
        ]
        passes = 0
        while active := [r for r, w in enumerate(windows) if w.drafting]:
            width = max(len(windows[r].pending) for r in active)
            idx = torch.tensor(active, dtype=torch.int64, device=self.device)
            tokens = torch.zeros((len(active), width), dtype=torch.int64, device=self.device)
            for a, r in enumerate(active):
                pending = windows[r].pending
                tokens[a, : len(pending)] = torch.tensor(pending, dtype=torch.int64)
            prefix = torch.tensor([kept[r] + fed[r] for r in active], dtype=torch.int64, device=self.device)
            out = torch.stack([scratch[r][fed[r] : fed[r] + width] for r in active])
            positions = (
                torch.tensor([windows[r].position for r in active], dtype=torch.int64, device=self.device)[:, None]
                + torch.arange(width, device=self.device)[None]
            )
            if width == 1:
                fb = self.forwards.draft(batch, tokens[:, 0], private[idx], prefix + 1, out[:, 0], positions[:, 0])
                logits = self.decode_pass(fb)
            else:
                logits = self.chain_pass(self.forwards.chain(batch, private[idx], tokens, prefix, out, positions))
            logits = logits.float().view(len(active), width, -1)
            passes += 1
            for a, r in enumerate(active):
                n = len(windows[r].pending)
                fed[r] += n  # before ``take``: a cut chain forgets from here
                windows[r].take(logits[a, :n])
        return windows, passes

    def _walk(self, grammar: BaseGrammarObject | None) -> WindowGrammar | None:
        return None if grammar is None else WindowGrammar(grammar, self.vocab_size, self.device)


def stop_ids(req: Req) -> set[int]:
    """The tokens that end ``req`` as SGLang's scheduler checks them (a window drafts nothing past one)."""
    if req.sampling_params.ignore_eos:
        return set()
    ids = set(req.sampling_params.stop_token_ids or ()) | set(req.eos_token_ids or ())
    tok = getattr(req, "tokenizer", None)
    if tok is not None:
        ids |= {tok.eos_token_id} - {None}
        ids |= set(getattr(tok, "additional_stop_token_ids", None) or ())
    return ids
