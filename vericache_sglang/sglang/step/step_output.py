"""A decode step's ``LogitsProcessorOutput``, laid out as SGLang's scheduler reads a speculative
step's: the verify logits, and for requests that asked for them the log-probabilities of each
committed token (``next_token_logprobs`` ``[bs, width]``; top and chosen-id log-probabilities as
flat lists of tensors, entry ``i * width + j`` for request ``i``'s ``j``-th committed token).

A drafted request's log-probabilities are what SGLang's sampler returns for the same token from
the same full-KV logits: ``log_softmax(logits / temperature)`` (temperature 1 for greedy) after the
grammar mask. An "own" request's come from SGLang's sampler itself (``own``, one token: column 0).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from sglang.srt.layers.logits_processor import LogitsProcessorOutput

from vericache_sglang.core.accept import Verdict
from vericache_sglang.sglang.step.request_plan import Plan

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req


def step_output(
    flat_logits: torch.Tensor,
    logits: torch.Tensor,
    reqs: list[Req],
    plans: list[Plan],
    verdicts: list[Verdict],
    own: LogitsProcessorOutput | None,
) -> LogitsProcessorOutput:
    """``flat_logits`` ``[bs * width, vocab]`` as verified; ``logits`` ``[bs, width, vocab]`` as the
    decisions read them (grammar masks applied)."""
    out = LogitsProcessorOutput(next_token_logits=flat_logits)
    if not any(req.return_logprob for req in reqs):
        return out
    bs, width = logits.shape[:2]
    chosen = logits.new_zeros((bs, width))
    tops = any(req.logprob.top_logprobs_num > 0 for req in reqs)
    ids = any(req.logprob.token_ids_logprob is not None for req in reqs)
    empty, empty_idx = torch.empty(0), torch.empty(0, dtype=torch.int64)
    top_val, top_idx = [empty] * (bs * width), [empty_idx] * (bs * width)
    ids_val, ids_idx = [empty] * (bs * width), [[] for _ in range(bs * width)]
    for i, (req, plan, verdict) in enumerate(zip(reqs, plans, verdicts, strict=True)):
        if not req.return_logprob:
            continue
        at = i * width
        if plan.own:
            chosen[i, 0] = own.next_token_logprobs[i]
            if tops and own.next_token_top_logprobs_val:
                top_val[at] = torch.as_tensor(own.next_token_top_logprobs_val[i])
                top_idx[at] = torch.as_tensor(own.next_token_top_logprobs_idx[i])
            if ids and own.next_token_token_ids_logprobs_val:
                ids_val[at] = torch.as_tensor(own.next_token_token_ids_logprobs_val[i])
                ids_idx[at] = list(own.next_token_token_ids_logprobs_idx[i])
            continue
        n = len(verdict.tokens)
        temperature = plan.sampler.params.temperature or 1.0
        logprobs = torch.log_softmax(logits[i, :n].float() / temperature, dim=-1)
        tokens = torch.tensor(verdict.tokens, device=logprobs.device)
        chosen[i, :n] = logprobs.gather(1, tokens[:, None])[:, 0]
        if req.logprob.top_logprobs_num > 0:
            values, indices = logprobs.topk(req.logprob.top_logprobs_num, dim=-1)
            for j in range(n):
                top_val[at + j], top_idx[at + j] = values[j], indices[j]
        if req.logprob.token_ids_logprob is not None:
            wanted = torch.tensor(req.logprob.token_ids_logprob, device=logprobs.device)
            for j in range(n):
                ids_val[at + j], ids_idx[at + j] = logprobs[j, wanted], list(req.logprob.token_ids_logprob)
    out.next_token_logprobs = chosen
    if tops:
        out.next_token_top_logprobs_val, out.next_token_top_logprobs_idx = top_val, top_idx
    if ids:
        out.next_token_token_ids_logprobs_val, out.next_token_token_ids_logprobs_idx = ids_val, ids_idx
    return out
