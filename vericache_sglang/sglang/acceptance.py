"""The core's acceptance decisions, packed as the tensors SGLang's scheduler reads from a verify.

The decision itself is ``vericache_sglang.core.accept`` (greedy: ``greedy_accept``; sampled:
``rejection_accept`` with the core's position-keyed sampler); nothing here decides anything.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any

import torch

from vericache_sglang.core.accept import Verdict, greedy_accept, rejection_accept
from vericache_sglang.core.sampling import STREAM_DRAFT, Sampler, SamplingParams


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
    return PackedVerdicts(output_ids.to(device), accept_lens.to(device),
                          committed_seq_lens + accept_lens.to(device=device, dtype=committed_seq_lens.dtype),
                          next_seeds.to(device), verdicts)


def greedy_verdicts(drafts: torch.Tensor, target_top1: torch.Tensor) -> list[Verdict]:
    """``drafts`` ``[bs, x]``, ``target_top1`` ``[bs, x + 1]`` (the verifier's argmax after the seed
    and after each draft): the core's greedy decision for each request."""
    d, t = drafts.tolist(), target_top1.tolist()
    return [greedy_accept(di, ti) for di, ti in zip(d, t, strict=True)]


# -- sampled requests ---------------------------------------------------------------------------

TOP_K_ALL = 1 << 30  # SGLang's "whole vocabulary" top_k


class UnsupportedSampling(ValueError):
    """A request's sampling settings the worker cannot verify (the request is aborted with this)."""


def core_sampling(params: Any, rid: str) -> SamplingParams:
    """The core's sampling parameters for an SGLang request's ``SamplingParams``.

    SGLang encodes temperature 0 as ``top_k=1``. Settings that reshape the distribution from the
    request's history (penalties), ``min_p`` and ``logit_bias`` are refused: the core's sampler,
    which drafting and verification must share, does not apply them. A request without a
    ``sampling_seed`` gets one from its id, so its draws are keyed by (seed, position) like all."""
    if int(params.top_k) == 1:
        return SamplingParams()
    unsupported = [name for name, value, neutral in (
        ("min_p", params.min_p, 0.0), ("frequency_penalty", params.frequency_penalty, 0.0),
        ("presence_penalty", params.presence_penalty, 0.0), ("repetition_penalty", params.repetition_penalty, 1.0),
    ) if float(value) != neutral]
    if params.logit_bias:
        unsupported.append("logit_bias")
    if unsupported:
        raise UnsupportedSampling(f"VeriCache verifies sampling with temperature, top_k, top_p and a seed; "
                                  f"this request also sets {', '.join(unsupported)}")
    top_k = int(params.top_k)
    seed = params.sampling_seed if params.sampling_seed is not None else zlib.crc32(rid.encode())
    return SamplingParams(temperature=float(params.temperature), top_k=0 if top_k <= 0 or top_k >= TOP_K_ALL else top_k,
                          top_p=float(params.top_p), seed=int(seed))


def draft_tokens(logits: torch.Tensor, samplers: list[Sampler], positions: list[int],
                 rejection: bool) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """One draft per request from the compressed-KV ``logits`` ``[bs, vocab]``, request ``i``'s at
    ``positions[i]``. Greedy: the argmax. Sampled: the core's position-keyed draw, on the token
    stream (so it equals the verifier's draw wherever the distributions agree) or, with
    ``rejection``, on the draft stream with the draft distribution kept for the acceptance."""
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


def sampled_verdicts(drafts: torch.Tensor, draft_probs: list[list[torch.Tensor | None]], target_logits: torch.Tensor,
                     committed: list[int], samplers: list[Sampler], rejection: bool) -> list[Verdict]:
    """The core's decision per request: ``drafts`` ``[bs, x]``; ``draft_probs[j][i]`` the draft
    distribution of request ``i`` at pass ``j`` (rejection only); ``target_logits`` ``[bs, x + 1,
    vocab]`` from the verify pass; ``committed[i]`` the position of request ``i``'s seed."""
    x = drafts.shape[1]
    verdicts = []
    for i, sampler in enumerate(samplers):
        draft = drafts[i].tolist()
        positions = [committed[i] + 1 + k for k in range(x + 1)]  # each draft's, then the bonus's
        if rejection and not sampler.params.greedy:
            q = torch.stack([draft_probs[j][i] for j in range(x)])
            verdicts.append(rejection_accept(draft, q, sampler.probs(target_logits[i]), positions, sampler))
        else:
            verdicts.append(greedy_accept(draft, sampler.sample(target_logits[i], positions).tolist()))
    return verdicts
