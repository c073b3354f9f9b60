"""What the batch engine (``batch``) is given and reports: its modes and config, a submitted job,
its statistics, and a request decoded one token per iteration (the full-KV and lossy modes).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, get_args

from vericache_sglang.core.compress import Compressor
from vericache_sglang.core.kv import CompressedKV
from vericache_sglang.core.sampling import Sampler
from vericache_sglang.engine.fetch import FullKVFetch
from vericache_sglang.engine.generation import GenerationConfig, GenerationResult, Output, Prefill
from vericache_sglang.engine.prefix import RegisteredPrefix
from vericache_sglang.engine.runner import ResidentKV, SegmentOutput

BatchMode = Literal["full_resident", "full_offloaded", "lossy", "vericache"]
Schedule = Literal["staggered", "lockstep"]
MODES: tuple[str, ...] = get_args(BatchMode)
SCHEDULES: tuple[str, ...] = get_args(Schedule)


@dataclass
class BatchConfig:
    mode: BatchMode = "vericache"
    schedule: Schedule = "staggered"
    kv_budget_bytes: int = 1 << 30
    window: int = 64  # the scheduler's look-ahead, in iterations
    max_running: int = 64
    # A verification the scheduler places later than the request's horizon: keep drafting until it
    # (more tokens per reload; nearly free where decoding is memory-bound, as on a GPU) or stop at
    # the horizon and wait (the default: extra rows cost compute where decoding is compute-bound,
    # and the horizon stays what was configured).
    draft_until_verify: bool = False

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}; choices: {', '.join(MODES)}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule {self.schedule!r}; choices: {', '.join(SCHEDULES)}")
        if self.kv_budget_bytes <= 0:
            raise ValueError(f"kv_budget_bytes must be > 0, got {self.kv_budget_bytes}")


@dataclass
class BatchStats:
    iterations: int = 0
    wall_s: float = 0.0
    generated_tokens: int = 0
    peak_running: int = 0
    peak_device_bytes: int = 0
    transfer_s: float = 0.0  # wall time during which at least one full-KV fetch was in flight
    stall_s: float = 0.0  # time iterations waited for a fetch to complete
    fetched_bytes: int = 0
    verify_passes: int = 0
    waiting_iterations: int = 0  # request-iterations spent in the scheduler's waiting queue
    max_verifies_per_iteration: int = 0  # how bunched verifications (and their reloads) are
    rows: int = 0  # token rows the forwards computed (drafts, verifies, decodes)
    attended_keys: int = 0  # (row, key) pairs their attention scored, over layers: with rows, the compute spent

    @property
    def throughput_tok_s(self) -> float:
        return self.generated_tokens / self.wall_s if self.wall_s else 0.0

    @property
    def hidden_transfer_fraction(self) -> float:
        """Share of full-KV transfer time hidden behind compute (1 - stall / transfer)."""
        return 1.0 - self.stall_s / self.transfer_s if self.transfer_s else 0.0


def union_length(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


@dataclass
class Job:
    """A submitted request: its prefill (or, for a prompt that starts with a registered document, the
    document's prefix and no prefill), its own generation settings and compressor, and where its
    committed tokens, result or failure go (a server streams them; benchmarks read ``results``)."""

    rid: str
    pre: Prefill | None
    gen: GenerationConfig
    compressor: Compressor
    on_commit: Callable[[list[int]], None] | None = None
    on_done: Callable[[GenerationResult], None] | None = None
    on_error: Callable[[BaseException], None] | None = None
    compressed_bytes: int | None = None  # its compressed prompt's size, measured once
    # The compressed prompt made to size the job, handed to the request that starts it (compressing
    # twice would run KVzip's reconstruction twice). Only the queue's head is sized, so at most one
    # waiting job holds one.
    ckv: CompressedKV | None = None
    prefix: RegisteredPrefix | None = None
    prompt: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.pre is not None:
            self.prompt = self.pre.tokens
        elif self.prefix is None:
            raise ValueError(f"request {self.rid}: a job needs a prefill or a registered prefix")


class PlainRequest:
    """A request decoded one token per iteration on a resident, offloaded or compressed KV."""

    def __init__(
        self,
        rid: str,
        pre: Prefill,
        cfg: GenerationConfig,
        method: str,
        tokenizer: object | None,
        compressor: Compressor,
        on_commit: Callable[[list[int]], None] | None = None,
    ):
        self.rid = rid
        self.cfg = cfg
        self.compressor = compressor
        self.out = Output(method, cfg, tokenizer, on_commit)
        self.sampler = Sampler(cfg.sampling)
        self.tokens = list(pre.tokens)
        self.started = time.monotonic()
        # what the mode keeps: a resident full KV, a compressed KV, or the store handle and its fetch
        self.ctx: ResidentKV | None = None
        self.ckv = None
        self.kv = None
        self.pending = None
        self.feed: FullKVFetch | None = None
        first = int(self.sampler.sample(pre.logits[None], [len(self.tokens)])[0])
        self.out.commit([first], pre.logits[None])
        self.tokens.append(first)

    def take(self, out: SegmentOutput) -> None:
        token = int(self.sampler.sample(out.logits, [len(self.tokens)])[0])
        self.out.commit([token], out.logits)
        self.tokens.append(token)
        self.out.stats.decode_steps += 1

    def result(self) -> GenerationResult:
        self.out.stats.decode_s = time.monotonic() - self.started
        return self.out.result()
