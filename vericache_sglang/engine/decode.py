"""The decoding loops: full-KV (the reference), lossy (compressed KV alone), and VeriCache.

VeriCache, one request (docs/architecture.md, the data path):

    fetch of the full KV starts  ─┐  (background thread: write last commit, then layer by layer)
    draft x tokens on compressed  │
    verify over the full KV  ◄────┘  (waits per layer)
    accept; commit the verifier's exact K/V to the store and into the compressed KV

Only committed tokens leave ``generate_vericache``; every one of them is a verifier's token.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from tqdm import tqdm

from remote_store.backends.base import StoreError
from remote_store.codec import ChunkError
from vericache_sglang.core.compress import Compressor
from vericache_sglang.core.sampling import Sampler
from vericache_sglang.engine.generation import (
    GenerationConfig,
    GenerationResult,
    GenerationStats,
    Output,
    Prefill,
    VerifyTiming,
)
from vericache_sglang.engine.prefill import recompute_full_kv
from vericache_sglang.engine.request import VeriCacheRequest
from vericache_sglang.engine.runner import (
    ContextKV,
    DraftKV,
    ModelRunner,
    ResidentKV,
    Segment,
    SegmentOutput,
    Timeline,
)
from vericache_sglang.full_kv.store import FullKVStore

if TYPE_CHECKING:
    from vericache_sglang.engine.prefix import RegisteredPrefix

__all__ = [
    "GenerationConfig",
    "GenerationResult",
    "GenerationStats",
    "Prefill",
    "VerifyTiming",
    "generate_full",
    "generate_lossy",
    "generate_vericache",
    "generate_vericache_from_prefix",
    "run_request",
]


def _decode_one_by_one(
    runner: ModelRunner,
    pre: Prefill,
    cfg: GenerationConfig,
    out: Output,
    context: Callable[[], ContextKV],
    after: Callable[[int, SegmentOutput], None] | None = None,
    keep_queries: int = 0,
) -> None:
    """Commit the prefill's token, then one token per forward over ``context()`` until the stop.
    With a constraint, each token is chosen from the logits its grammar allows there."""
    sampler = Sampler(cfg.sampling)
    state = cfg.constraint.state() if cfg.constraint is not None else None

    def choose(logits: torch.Tensor, pos: int) -> tuple[int, torch.Tensor]:
        if state is not None:
            logits = state.apply(logits)
        token = int(sampler.sample(logits, [pos])[0])
        if state is not None:
            state.advance(token)
        return token, logits

    pos = len(pre.tokens)
    token, logits = choose(pre.logits[None], pos)
    out.commit([token], logits)
    while not out.stop.done and pos + 1 < runner.max_positions:
        step = runner.forward([Segment([token], [pos], context(), logits="last", keep_queries=keep_queries)])[0]
        if after is not None:
            after(pos, step)
        out.stats.decode_steps += 1
        pos += 1
        token, logits = choose(step.logits, pos)
        out.commit([token], logits)
    out.stats.prefill_s = pre.seconds


def generate_full(
    runner: ModelRunner,
    pre: Prefill,
    cfg: GenerationConfig,
    tokenizer: object | None = None,
    on_commit: Callable[[list[int]], None] | None = None,
) -> GenerationResult:
    """Full-KV decoding, one token per forward, the full KV resident: the reference."""
    out = Output("full", cfg, tokenizer, on_commit)
    t0 = time.monotonic()
    ctx = ResidentKV.from_full(pre.kv, len(pre.tokens) + cfg.max_new_tokens, runner.device)
    _decode_one_by_one(runner, pre, cfg, out, lambda: ctx)
    out.stats.decode_s = time.monotonic() - t0
    out.stats.full_kv_bytes = ctx.length * runner.layout.bytes_per_token
    return out.result()


def generate_lossy(
    runner: ModelRunner,
    pre: Prefill,
    compressor: Compressor,
    cfg: GenerationConfig,
    tokenizer: object | None = None,
    on_commit: Callable[[list[int]], None] | None = None,
) -> GenerationResult:
    """Decoding with the compressed KV alone (the lossy baseline the compressor would give): each
    step's own K/V is folded into the compressed KV."""
    out = Output(f"lossy[{compressor.spec}]", cfg, tokenizer, on_commit)
    t0 = time.monotonic()
    ckv = compressor.compress(pre.kv, pre.obs)

    def fold(pos: int, step: SegmentOutput) -> None:
        compressor.commit(ckv, step.kv, torch.tensor([pos]), step.queries)

    _decode_one_by_one(runner, pre, cfg, out, lambda: DraftKV(ckv), fold, keep_queries=int(compressor.update_queries))
    out.stats.decode_s = time.monotonic() - t0
    out.stats.compressed_kv_bytes = ckv.nbytes
    return out.result()


def generate_vericache(
    runner: ModelRunner,
    pre: Prefill,
    compressor: Compressor,
    store: FullKVStore,
    cfg: GenerationConfig,
    tokenizer: object | None = None,
    on_commit: Callable[[list[int]], None] | None = None,
    request_id: str | None = None,
    timings: list[VerifyTiming] | None = None,
    progress: bool = False,
) -> GenerationResult:
    """Lossless decoding: draft on the compressed KV, verify each window over the full KV, which the
    verify pass consumes layer by layer as it arrives.

    ``timings``, when given, receives each verification's fetch and per-layer compute times.
    """
    req = VeriCacheRequest(
        runner,
        pre,
        compressor,
        store,
        cfg,
        tokenizer,
        on_commit,
        request_id,
        recompute=lambda tokens: recompute_full_kv(runner, tokens),
    )
    return run_request(runner, req, timings, progress)


def generate_vericache_from_prefix(
    runner: ModelRunner,
    prefix: RegisteredPrefix,
    prompt: list[int],
    compressor: Compressor,
    store: FullKVStore,
    cfg: GenerationConfig,
    tokenizer: object | None = None,
    on_commit: Callable[[list[int]], None] | None = None,
    request_id: str | None = None,
) -> tuple[GenerationResult, VeriCacheRequest]:
    """VeriCache for a prompt that starts with a registered prefix: no prefill; drafting starts at
    once over the prefix's compressed KV, and the first verification recomputes the prompt's own
    tokens over the prefix's full KV."""
    req = VeriCacheRequest(
        runner,
        None,
        compressor,
        store,
        cfg,
        tokenizer,
        on_commit,
        request_id,
        recompute=lambda tokens: recompute_full_kv(runner, tokens),
        prompt=prompt,
        prefix_ckv=prefix.ckv.clone(),
        prefix_len=len(prefix.tokens),
    )
    return run_request(runner, req), req


def run_request(
    runner: ModelRunner, req: VeriCacheRequest, timings: list[VerifyTiming] | None = None, progress: bool = False
) -> GenerationResult:
    """Step one request to the end: fetch, draft, verify (consuming the full KV layer by layer)."""
    bar = tqdm(total=req.cfg.max_new_tokens, desc="vericache", unit="tok", disable=not progress, leave=False)
    bar.update(len(req.out.stop.tokens))
    try:
        while not req.done:
            req.start_fetch()
            req.begin_window(req.next_horizon())
            while req.drafting:
                req.take_draft(runner.forward([req.draft_segment()])[0])
            timeline = Timeline()
            try:
                verify = runner.forward([req.verify_segment()], timeline)[0]
            except (StoreError, ChunkError) as e:
                req.recover(e)
                verify = runner.forward([req.verify_segment()])[0]
            before = len(req.out.stop.tokens)
            req.take_verify(verify, timeline, timings)
            bar.update(len(req.out.stop.tokens) - before)
    finally:
        bar.close()
        req.release()
    return req.result()
