"""The core's acceptance decisions, packed as the tensors SGLang's scheduler reads from a verify.

The decision itself is ``vericache_sglang.core.accept`` (greedy: ``greedy_accept``; sampled: the
core's position-keyed sampler, with ``rejection_accept`` for ``verification: "rejection"``); nothing
here decides anything.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vericache_sglang.core.accept import Verdict, greedy_accept, rejection_accept
from vericache_sglang.core.sampling import STREAM_DRAFT, Sampler


@dataclass
class PackedVerdicts:
    output_ids: torch.Tensor  # [bs, x + 1]: committed tokens first, the rest padding (0)
    accept_lens: torch.Tensor  # [bs] committed tokens per request (accepted drafts + 1)
    new_seq_lens: torch.Tensor  # [bs] committed length after this step
    next_seeds: torch.Tensor  # [bs] the last committed token: the next draft starts from it
    verdicts: list[Verdict]


def pack(verdicts: list[Verdict], width: int, committed_seq_lens: torch.Tensor) -> PackedVerdicts:
    bs = len(verdicts)
    device = committed_seq_lens.device
    output_ids = torch.zeros((bs, width), dtype=torch.int64)
    for i, v in enumerate(verdicts):
        if len(v.tokens) > width:
            raise ValueError(f"verdict of {len(v.tokens)} tokens does not fit width {width}")
        output_ids[i, : len(v.tokens)] = torch.tensor(v.tokens, dtype=torch.int64)
    accept_lens = torch.tensor([len(v.tokens) for v in verdicts], dtype=torch.int32)
    next_seeds = torch.tensor([v.tokens[-1] for v in verdicts], dtype=torch.int64)
    return PackedVerdicts(
        output_ids.to(device),
        accept_lens.to(device),
        committed_seq_lens + accept_lens.to(device=device, dtype=committed_seq_lens.dtype),
        next_seeds.to(device),
        verdicts,
    )


def draws(
    logits: torch.Tensor, samplers: list[Sampler], positions: list[int], rejection: bool
) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """One draft per row of the compressed-KV ``logits`` ``[n, vocab]``, row ``i``'s at
    ``positions[i]``: the argmax (greedy), the core's position-keyed draw on the token stream (so it
    equals the verifier's draw wherever the distributions agree) or, with ``rejection``, on the draft
    stream with the draft distribution kept for the acceptance."""
    tokens = logits.argmax(dim=-1)
    probs: list[torch.Tensor | None] = [None] * len(samplers)
    for i, sampler in enumerate(samplers):
        if sampler.params.greedy:
            continue
        row = logits[i : i + 1]
        if rejection:
            probs[i] = sampler.probs(row)[0]
            tokens[i] = sampler.sample(row, [positions[i]], STREAM_DRAFT)[0]
        else:
            tokens[i] = sampler.sample(row, [positions[i]])[0]
    return tokens, probs


def verdict(
    draft: list[int],
    draft_probs: list[torch.Tensor | None],
    target: torch.Tensor,
    seed_position: int,
    sampler: Sampler,
    rejection: bool,
) -> Verdict:
    """The core's decision for one request: ``draft`` its ``k`` drafts (``draft_probs`` their
    distributions, rejection sampling only), ``target`` ``[k + 1, vocab]`` the full-KV logits after
    the seed (at ``seed_position``) and after each draft."""
    positions = [seed_position + 1 + j for j in range(len(draft) + 1)]  # each draft's, then the bonus's
    if sampler.params.greedy:
        return greedy_accept(draft, target.argmax(dim=-1).tolist())
    if rejection and draft:
        return rejection_accept(draft, torch.stack(draft_probs), sampler.probs(target), positions, sampler)
    return greedy_accept(draft, sampler.sample(target, positions).tolist())
