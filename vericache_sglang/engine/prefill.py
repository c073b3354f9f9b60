"""Exact prefill, the one way a prompt's full KV is computed: in chunks, keeping the last
``OBS_WINDOW`` queries per layer for the compressors that score by them (SnapKV's observation
window); and its reuse when the store cannot serve a request's full KV (recomputation).

A leaf module: the decoding loops (``decode``) and the prefix registry (``prefix``) both build on it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from tqdm import tqdm

from vericache_sglang.core.compress import Observation
from vericache_sglang.core.kv import FullKV
from vericache_sglang.engine.generation import Prefill
from vericache_sglang.engine.observe import RunnerObservation
from vericache_sglang.engine.runner import ModelRunner, ResidentKV, Segment

__all__ = ["OBS_WINDOW", "prefill", "recompute_full_kv"]

OBS_WINDOW = 64  # prefill queries kept for scoring compressors


def prefill(
    runner: ModelRunner, tokens: Sequence[int], chunk: int = 512, progress: bool = False, prefix: FullKV | None = None
) -> Prefill:
    """Exact prefill in chunks; ``prefix`` is stored full KV of ``tokens[:prefix.num_tokens]``."""
    tokens = [int(t) for t in tokens]
    if not tokens:
        raise ValueError("empty prompt")
    if len(tokens) >= runner.max_positions:
        raise ValueError(
            f"prompt of {len(tokens)} tokens does not fit the model's context of {runner.max_positions} positions"
        )
    t0 = time.monotonic()
    reused = 0 if prefix is None else min(prefix.num_tokens, len(tokens) - 1)
    ctx = (
        ResidentKV(runner.layout, len(tokens), runner.device)
        if not reused
        else ResidentKV.from_full(prefix.slice(0, reused), len(tokens), runner.device)
    )
    queries: list[torch.Tensor | None] = [None] * runner.layout.num_layers  # the last OBS_WINDOW, per layer
    starts = list(range(reused, len(tokens), chunk))
    bar = tqdm(total=len(tokens) - reused, desc="prefill", unit="tok", disable=not progress, leave=False)
    logits = None
    for start in starts:
        end = min(start + chunk, len(tokens))
        last = end == len(tokens)
        out = runner.forward(
            [
                Segment(
                    tokens[start:end],
                    list(range(start, end)),
                    ctx,
                    logits="last" if last else "none",
                    keep_queries=OBS_WINDOW,
                )
            ]
        )[0]
        for layer, q in enumerate(out.queries):
            kept = q if queries[layer] is None else torch.cat([queries[layer], q], dim=1)
            queries[layer] = kept[:, -OBS_WINDOW:]
        logits = out.logits
        bar.update(end - start)
    bar.close()
    kv = ctx.to_full()
    obs = Observation(queries, RunnerObservation(runner, tokens, kv))
    return Prefill(tokens, kv, logits[0], obs, time.monotonic() - t0, reused)


def recompute_full_kv(runner: ModelRunner, tokens: list[int]) -> ResidentKV:
    """The exact full KV of ``tokens``, recomputed when the store cannot serve it."""
    return ResidentKV.from_full(prefill(runner, tokens).kv, len(tokens) + 1024, runner.device)
