"""The decoding loops: full-KV (the reference), lossy (compressed KV alone), and VeriCache.

VeriCache, one request (DESIGN.md's data path):

    fetch of the full KV starts  ─┐  (background thread: write last commit, then layer by layer)
    draft x tokens on compressed  │
    verify over the full KV  ◄────┘  (waits per layer)
    accept; commit the verifier's exact K/V to the store and into the compressed KV

Only committed tokens leave ``generate_vericache``; every one of them is a verifier's token.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from remote_store.backends.base import StoreError
from remote_store.codec import ChunkError
from remote_store.fullkv import FullKVStore
from vericache_sglang.core.accept import Verdict, greedy_accept, rejection_accept
from vericache_sglang.core.compress import Compressor, Observation
from vericache_sglang.core.kv import FullKV
from vericache_sglang.core.sampling import STREAM_DRAFT, Sampler, SamplingParams
from vericache_sglang.engine.fetch import FetchError, FullKVFetch, ResidentFeed
from vericache_sglang.engine.runner import DraftKV, ModelRunner, ResidentKV, Segment, StreamedKV, Timeline
from vericache_sglang.engine.stop import StopChecker

log = logging.getLogger(__name__)

OBS_WINDOW = 64  # prefill queries kept for scoring compressors


@dataclass
class Prefill:
    tokens: list[int]
    kv: FullKV  # exact KV of every prompt token
    logits: torch.Tensor  # float32 [vocab], at the last prompt token
    obs: Observation
    seconds: float
    reused_tokens: int = 0  # prefix KV taken from the store instead of computed


def prefill(runner: ModelRunner, tokens: Sequence[int], chunk: int = 512, progress: bool = False,
            prefix: FullKV | None = None) -> Prefill:
    """Exact prefill in chunks; ``prefix`` is stored full KV of ``tokens[:prefix.num_tokens]``."""
    tokens = [int(t) for t in tokens]
    if not tokens:
        raise ValueError("empty prompt")
    if len(tokens) >= runner.max_positions:
        raise ValueError(f"prompt of {len(tokens)} tokens does not fit the model's context of "
                         f"{runner.max_positions} positions")
    t0 = time.monotonic()
    reused = 0 if prefix is None else min(prefix.num_tokens, len(tokens) - 1)
    ctx = (ResidentKV(runner.layout, len(tokens), runner.device) if not reused
           else ResidentKV.from_full(prefix.slice(0, reused), len(tokens), runner.device))
    queries: list[list[torch.Tensor]] = [[] for _ in range(runner.layout.num_layers)]
    starts = list(range(reused, len(tokens), chunk))
    bar = tqdm(total=len(tokens) - reused, desc="prefill", unit="tok", disable=not progress, leave=False)
    logits = None
    for start in starts:
        end = min(start + chunk, len(tokens))
        last = end == len(tokens)
        out = runner.forward([Segment(tokens[start:end], list(range(start, end)), ctx,
                                      logits="last" if last else "none", keep_queries=OBS_WINDOW)])[0]
        for layer, q in enumerate(out.queries):
            queries[layer] = [*queries[layer], q]
            joined = torch.cat(queries[layer], dim=1)
            queries[layer] = [joined[:, -OBS_WINDOW:]]
        logits = out.logits
        bar.update(end - start)
    bar.close()
    obs = Observation([q[0] for q in queries])
    return Prefill(tokens, ctx.to_full(), logits[0], obs, time.monotonic() - t0, reused)


@dataclass
class GenerationConfig:
    max_new_tokens: int = 128
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_strings: tuple[str, ...] = ()
    eos_token_ids: tuple[int, ...] = ()
    horizon: int = 16  # drafted tokens per verification
    verify: str = "exact"  # "exact": position-keyed coupling; "rejection": speculative rejection sampling
    logprobs: bool = False
    keep_logits: bool = False  # keep the logits of every committed token (for --check)
    on_store_error: str = "recompute"  # "recompute" the full KV and go on, or "fail" the request
    fetch_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if self.horizon < 1:
            raise ValueError(f"horizon must be >= 1, got {self.horizon}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.verify not in ("exact", "rejection"):
            raise ValueError(f"verify must be 'exact' or 'rejection', got {self.verify!r}")
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


class _Output:
    """Collects committed tokens in order, cutting at the stop condition."""

    def __init__(self, method: str, cfg: GenerationConfig, tokenizer: object | None,
                 on_commit: Callable[[list[int]], None] | None):
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
            self.method, list(self.stop.tokens), self.stop.text, self.stop.finish_reason or "length",
            self.stats, self.logprobs if self.cfg.logprobs else None,
            self.logits if self.cfg.keep_logits else None,
        )


def generate_full(runner: ModelRunner, pre: Prefill, cfg: GenerationConfig, tokenizer: object | None = None,
                  on_commit: Callable[[list[int]], None] | None = None) -> GenerationResult:
    """Full-KV decoding, one token per forward, the full KV resident: the reference."""
    out = _Output("full", cfg, tokenizer, on_commit)
    sampler = Sampler(cfg.sampling)
    t0 = time.monotonic()
    ctx = ResidentKV.from_full(pre.kv, len(pre.tokens) + cfg.max_new_tokens, runner.device)
    pos = len(pre.tokens)
    logits = pre.logits[None]
    token = int(sampler.sample(logits, [pos])[0])
    out.commit([token], logits)
    while not out.stop.done and pos + 1 < runner.max_positions:
        logits = runner.forward([Segment([token], [pos], ctx, logits="last")])[0].logits
        out.stats.decode_steps += 1
        pos += 1
        token = int(sampler.sample(logits, [pos])[0])
        out.commit([token], logits)
    out.stats.decode_s = time.monotonic() - t0
    out.stats.prefill_s = pre.seconds
    out.stats.full_kv_bytes = ctx.length * runner.layout.bytes_per_token
    return out.result()


def generate_lossy(runner: ModelRunner, pre: Prefill, compressor: Compressor, cfg: GenerationConfig,
                   tokenizer: object | None = None,
                   on_commit: Callable[[list[int]], None] | None = None) -> GenerationResult:
    """Decoding with the compressed KV alone (the lossy baseline the compressor would give)."""
    out = _Output(f"lossy[{compressor.spec}]", cfg, tokenizer, on_commit)
    sampler = Sampler(cfg.sampling)
    t0 = time.monotonic()
    ckv = compressor.compress(pre.kv, pre.obs)
    pos = len(pre.tokens)
    logits = pre.logits[None]
    token = int(sampler.sample(logits, [pos])[0])
    out.commit([token], logits)
    while not out.stop.done and pos + 1 < runner.max_positions:
        step = runner.forward([Segment([token], [pos], DraftKV(ckv), logits="last")])[0]
        for layer, (k, v) in enumerate(step.kv):
            compressor.update(ckv, layer, k, v, torch.tensor([pos]))
        out.stats.decode_steps += 1
        pos += 1
        logits = step.logits
        token = int(sampler.sample(logits, [pos])[0])
        out.commit([token], logits)
    out.stats.decode_s = time.monotonic() - t0
    out.stats.prefill_s = pre.seconds
    out.stats.compressed_kv_bytes = ckv.nbytes
    return out.result()


def generate_vericache(
    runner: ModelRunner, pre: Prefill, compressor: Compressor, store: FullKVStore, cfg: GenerationConfig,
    tokenizer: object | None = None, on_commit: Callable[[list[int]], None] | None = None,
    request_id: str | None = None, timings: list[VerifyTiming] | None = None,
    progress: bool = False,
) -> GenerationResult:
    """Lossless decoding: draft on the compressed KV, verify each window over the full KV.

    ``timings``, when given, receives each verification's fetch and per-layer compute times.
    """
    out = _Output(f"vericache[{compressor.spec}]", cfg, tokenizer, on_commit)
    stats = out.stats
    sampler = Sampler(cfg.sampling)
    rejection = cfg.verify == "rejection" and not cfg.sampling.greedy
    t0 = time.monotonic()
    ckv = compressor.compress(pre.kv, pre.obs)
    request = store.open_request(pre.tokens, request_id)
    tokens = list(pre.tokens)
    pending = (0, pre.kv.layers)  # the prompt's full KV goes to the store once, on the fetch thread
    resident: ResidentKV | None = None  # the recompute fallback, once the store has failed
    bar = tqdm(total=cfg.max_new_tokens, desc="vericache", unit="tok", disable=not progress, leave=False)

    first = int(sampler.sample(pre.logits[None], [len(tokens)])[0])
    out.commit([first], pre.logits[None])
    done = out.stop.done
    tokens.append(first)
    request.extend_tokens([first])
    bar.update(1)
    try:
        while not done:
            n = len(tokens)  # positions [0, n - 1) have KV; token n - 1 is the next input
            x = max(0, min(cfg.horizon, out.stop.remaining - 1, runner.max_positions - n - 1))
            # The rows the compressed KV holds bit-exactly need not cross the link again.
            feed = (FullKVFetch(request, n - 1, runner.layout.num_layers, pending, cfg.fetch_timeout_s,
                                held=lambda layer: ckv.layers[layer].exact_kv())
                    if resident is None else ResidentFeed(resident.to_full()))
            pending = None
            drafts, draft_probs = _draft(runner, ckv, tokens[-1], n - 1, x, sampler, cfg, rejection)
            stats.decode_steps += len(drafts)
            inputs, positions = [tokens[-1], *drafts], list(range(n - 1, n + len(drafts)))
            timeline = Timeline()
            try:
                verify = runner.forward([Segment(inputs, positions, StreamedKV(feed))], timeline)[0]
            except (StoreError, ChunkError) as e:
                feed.join()
                if cfg.on_store_error == "fail":
                    raise FetchError(f"verification failed, no unverified token emitted: {e}") from e
                log.warning("full-KV fetch failed (%s); recomputing the full KV", e)
                stats.store_fallbacks += 1
                resident = _recompute(runner, tokens[: n - 1])
                feed = ResidentFeed(resident.to_full())
                verify = runner.forward([Segment(inputs, positions, StreamedKV(feed))])[0]
            feed.join()
            if timings is not None:
                timings.append(VerifyTiming(getattr(feed, "started", None), list(feed.arrival),
                                            timeline.layer_start))
            stats.verify_passes += 1
            stats.fetch_wait_s += feed.wait_s
            stats.fetch_bytes.append(feed.bytes_fetched)
            verdict = _accept(verify.logits, drafts, draft_probs, positions, sampler, rejection)
            j = len(verdict.tokens)  # inputs [0, j) were right: their K/V is exact
            exact = [(k[:, :j], v[:, :j]) for k, v in verify.kv]
            for layer, (k, v) in enumerate(exact):
                compressor.update(ckv, layer, k, v, torch.tensor(positions[:j]))
            if resident is not None:
                resident.extend(exact)
            else:
                pending = (n - 1, exact)
            stats.drafted.append(len(drafts))
            stats.accepted.append(verdict.accepted)
            taken = out.commit(verdict.tokens, verify.logits[:j])
            stats.committed.append(taken)
            tokens.extend(verdict.tokens[:taken])
            request.extend_tokens(verdict.tokens[:taken])
            bar.update(taken)
            done = out.stop.done or len(tokens) >= runner.max_positions
    finally:
        bar.close()
        stats.store_put_bytes = request.stats.put_bytes
        request.release()
    stats.decode_s = time.monotonic() - t0
    stats.prefill_s = pre.seconds
    stats.compressed_kv_bytes = ckv.nbytes
    stats.full_kv_bytes = (len(tokens) - 1) * runner.layout.bytes_per_token
    return out.result()


def _draft(runner: ModelRunner, ckv, last: int, pos: int, x: int, sampler: Sampler, cfg: GenerationConfig,
           rejection: bool) -> tuple[list[int], list[torch.Tensor]]:
    """Draft up to ``x`` tokens after ``last`` (at ``pos``) on the compressed KV; scratch K/V only."""
    ctx = DraftKV(ckv)
    drafts: list[int] = []
    probs: list[torch.Tensor] = []
    token = last
    for i in range(x):
        logits = runner.forward([Segment([token], [pos + i], ctx, logits="last")])[0].logits
        if rejection:
            probs.append(sampler.probs(logits)[0])
            token = int(sampler.sample(logits, [pos + i + 1], STREAM_DRAFT)[0])
        else:
            token = int(sampler.sample(logits, [pos + i + 1])[0])
        drafts.append(token)
        if token in cfg.eos_token_ids:
            break  # nothing after an end of sequence can be committed
    return drafts, probs


def _accept(logits: torch.Tensor, drafts: list[int], draft_probs: list[torch.Tensor], positions: list[int],
            sampler: Sampler, rejection: bool) -> Verdict:
    token_positions = [p + 1 for p in positions]
    if rejection and drafts:
        return rejection_accept(drafts, torch.stack(draft_probs), sampler.probs(logits), token_positions,
                                sampler)
    return greedy_accept(drafts, sampler.sample(logits, token_positions).tolist())


def _recompute(runner: ModelRunner, tokens: list[int]) -> ResidentKV:
    """The exact full KV of ``tokens``, recomputed when the store cannot serve it."""
    return ResidentKV.from_full(prefill(runner, tokens).kv, len(tokens) + 1024, runner.device)
