"""The core's acceptance decisions, packed as the tensors SGLang's scheduler reads from a verify.

The decision itself is ``vericache_sglang.core.accept`` (greedy: ``greedy_accept``; sampled:
``rejection_accept`` with the core's position-keyed sampler); nothing here decides anything.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vericache_sglang.core.accept import Verdict, greedy_accept


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
