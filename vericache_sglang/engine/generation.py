"""What a generation takes and gives: its config, its prefill, its stats and result, and the
collector that commits tokens in order and cuts them at the stop condition."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from vericache_sglang.core.accept import VERIFICATIONS, Verification
from vericache_sglang.core.compress import Observation
from vericache_sglang.core.kv import FullKV
from vericache_sglang.core.sampling import SamplingParams
from vericache_sglang.engine.constraint import Constraint
from vericache_sglang.engine.stop import StopChecker


@dataclass
class Prefill:
    tokens: list[int]
    kv: FullKV  # exact KV of every prompt token
    logits: torch.Tensor  # float32 [vocab], at the last prompt token
    obs: Observation
    seconds: float
    reused_tokens: int = 0  # prefix KV taken from the store instead of computed


@dataclass
class GenerationConfig:
    max_new_tokens: int = 128
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_strings: tuple[str, ...] = ()
    eos_token_ids: tuple[int, ...] = ()
    horizon: int = 16  # drafted tokens per verification (with adaptive_horizon: the most)
    adaptive_horizon: bool = False  # choose each window's length from acceptance and measured costs
    verify: Verification = "exact"  # core.accept: position-keyed coupling, or speculative rejection sampling
    logprobs: bool = False
    keep_logits: bool = False  # keep the logits of every committed token (for --check)
    on_store_error: Literal["recompute", "fail"] = "recompute"  # recompute the full KV and go on, or fail
    fetch_timeout_s: float = 120.0
    constraint: Constraint | None = None  # a grammar every chosen token follows (structured outputs)

    def __post_init__(self) -> None:
        if self.horizon < 1:
            raise ValueError(f"horizon must be >= 1, got {self.horizon}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.verify not in VERIFICATIONS:
            raise ValueError(f"verify must be one of {', '.join(VERIFICATIONS)}, got {self.verify!r}")
        if self.on_store_error not in ("recompute", "fail"):
            raise ValueError(f"on_store_error must be 'recompute' or 'fail', got {self.on_store_error!r}")


@dataclass
class GenerationStats:
    prefill_s: float = 0.0
    decode_s: float = 0.0
    decode_steps: int = 0  # one-token forwards (full or lossy decoding, or drafting)
    verify_passes: int = 0
    drafted: list[int] = field(default_factory=list)  # per verification
    accepted: list[int] = field(default_factory=list)  # drafted tokens accepted, per verification
    committed: list[int] = field(default_factory=list)  # tokens committed, per verification
    draft_forwards: list[int] = field(default_factory=list)  # draft forwards, per verification
    lookup_drafted: int = 0  # drafts from prompt lookup (the rest from the compressed KV's model)
    lookup_accepted: int = 0  # of them, accepted
    fetch_bytes: list[int] = field(default_factory=list)  # full-KV bytes moved, per verification
    fetch_wait_s: float = 0.0  # verify time spent waiting for full-KV layers
    store_put_bytes: int = 0
    store_fallbacks: int = 0
    full_kv_bytes: int = 0
    compressed_kv_bytes: int = 0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens committed per verification: accepted drafts plus the verifier's own token."""
        return sum(self.committed) / len(self.committed) if self.committed else 0.0

    @property
    def acceptance_rate(self) -> float:
        return sum(self.accepted) / sum(self.drafted) if sum(self.drafted) else 0.0


@dataclass
class VerifyTiming:
    """One verification's timestamps (time.monotonic): overlap of fetch and compute, measured."""

    fetch_started: float | None  # None when the full KV was resident (recompute fallback)
    layer_arrival: list[float | None]  # when each layer's full KV had arrived
    layer_compute: list[float]  # when the verify pass started computing each layer


@dataclass
class GenerationResult:
    method: str
    tokens: list[int]
    text: str
    finish_reason: str
    stats: GenerationStats
    logprobs: list[float] | None = None
    logits: list[torch.Tensor] | None = None  # per committed token, when kept

    @property
    def tokens_per_second(self) -> float:
        return len(self.tokens) / self.stats.decode_s if self.stats.decode_s > 0 else 0.0


class Output:
    """Collects committed tokens in order, cutting at the stop condition."""

    def __init__(
        self,
        method: str,
        cfg: GenerationConfig,
        tokenizer: object | None,
        on_commit: Callable[[list[int]], None] | None,
    ):
        self.method = method
        self.cfg = cfg
        self.stop = StopChecker(tokenizer, cfg.eos_token_ids, cfg.stop_strings, cfg.max_new_tokens)
        self.logprobs: list[float] = []
        self.logits: list[torch.Tensor] = []
        self.stats = GenerationStats()
        self.on_commit = on_commit

    def commit(self, tokens: Sequence[int], logits: torch.Tensor) -> int:
        """Commit ``tokens`` (``logits[i]`` is the distribution ``tokens[i]`` was drawn from)."""
        taken = self.stop.feed_many(tokens)
        if self.cfg.logprobs:
            lp = logits[:taken].float().log_softmax(dim=-1)
            self.logprobs += [float(lp[i, t]) for i, t in enumerate(tokens[:taken])]
        if self.cfg.keep_logits:
            self.logits += [row.clone() for row in logits[:taken]]
        if self.on_commit is not None:
            self.on_commit(list(tokens[:taken]))
        return taken

    def result(self) -> GenerationResult:
        return GenerationResult(
            self.method,
            list(self.stop.tokens),
            self.stop.text,
            self.stop.finish_reason or "length",
            self.stats,
            self.logprobs if self.cfg.logprobs else None,
            self.logits if self.cfg.keep_logits else None,
        )
