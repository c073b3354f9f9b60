"""One VeriCache request's state machine, stepped by the single-request loop and the batch engine.

    start_fetch ─► begin_window(x) ─► draft_segment / take_draft (x times) ─► verify_segment ─► take_verify

Only ``take_verify`` commits tokens, from a verification's verdict. The fetch writes the previous
commit's exact K/V first, then reads the full KV for the next verification.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from remote_store.fullkv import FullKVStore
from vericache_sglang.core.accept import Verdict, greedy_accept, rejection_accept
from vericache_sglang.core.compress import Compressor
from vericache_sglang.core.sampling import STREAM_DRAFT, Sampler
from vericache_sglang.engine.fetch import FetchError, FullKVFetch, ResidentFeed
from vericache_sglang.engine.generation import GenerationConfig, GenerationResult, Output, Prefill, VerifyTiming
from vericache_sglang.engine.runner import (
    DraftKV,
    ModelRunner,
    ResidentKV,
    Segment,
    SegmentOutput,
    StreamedKV,
    Timeline,
)

log = logging.getLogger(__name__)


class VeriCacheRequest:
    def __init__(self, runner: ModelRunner, pre: Prefill, compressor: Compressor, store: FullKVStore,
                 cfg: GenerationConfig, tokenizer: object | None = None,
                 on_commit: Callable[[list[int]], None] | None = None, request_id: str | None = None,
                 recompute: Callable[[list[int]], ResidentKV] | None = None):
        self.runner = runner
        self.compressor = compressor
        self.cfg = cfg
        self.out = Output(f"vericache[{compressor.spec}]", cfg, tokenizer, on_commit)
        self.stats = self.out.stats
        self.sampler = Sampler(cfg.sampling)
        self.rejection = cfg.verify == "rejection" and not cfg.sampling.greedy
        self.started = time.monotonic()
        self.ckv = compressor.compress(pre.kv, pre.obs)
        self.kv = store.open_request(pre.tokens, request_id)
        self.request_id = self.kv.request_id
        self.tokens = list(pre.tokens)
        self.pending: tuple[int, list] | None = (0, pre.kv.layers)  # the prompt, written by the first fetch
        self.resident: ResidentKV | None = None  # the recompute fallback, once the store has failed
        self._recompute = recompute
        self.feed: FullKVFetch | ResidentFeed | None = None
        self.last_reload_bytes = 0
        self.drafts: list[int] = []
        self.draft_probs: list[torch.Tensor] = []
        self.x = 0
        self._draft_ctx: DraftKV | None = None
        self.stats.prefill_s = pre.seconds
        first = int(self.sampler.sample(pre.logits[None], [len(self.tokens)])[0])
        self._commit([first], pre.logits[None])

    @property
    def done(self) -> bool:
        return self.out.stop.done or len(self.tokens) >= self.runner.max_positions

    @property
    def context_tokens(self) -> int:
        """Positions whose KV exists (the last committed token is the next input)."""
        return len(self.tokens) - 1

    def next_horizon(self, horizon: int | None = None) -> int:
        """The draft length for the next window: the horizon, cut so nothing past the end is drafted."""
        x = self.cfg.horizon if horizon is None else horizon
        return max(0, min(x, self.out.stop.remaining - 1, self.runner.max_positions - len(self.tokens) - 1))

    def full_kv_bytes(self) -> int:
        return self.context_tokens * self.runner.layout.bytes_per_token

    # fetch
    def start_fetch(self) -> None:
        n = len(self.tokens)
        if self.resident is not None:
            self.feed = ResidentFeed(self.resident.to_full())
        else:
            # The rows the compressed KV holds bit-exactly need not cross the link again.
            self.feed = FullKVFetch(self.kv, n - 1, self.runner.layout.num_layers, self.pending,
                                    self.cfg.fetch_timeout_s, held=lambda layer: self.ckv.layers[layer].exact_kv())
        self.pending = None

    def wait_fetch(self) -> float:
        """Block until the fetch is complete; recover from its failure. Returns the seconds waited."""
        t = time.monotonic()
        self.feed.join()
        waited = time.monotonic() - t
        error = getattr(self.feed, "error", None)
        if error is not None:
            self.recover(error)
        return waited

    def recover(self, error: BaseException) -> None:
        """A fetch failed: fail the request (nothing unverified was emitted) or recompute the full KV."""
        self.feed.join()
        if self.cfg.on_store_error == "fail":
            raise FetchError(f"verification failed, no unverified token emitted: {error}") from error
        log.warning("request %s: full-KV fetch failed (%s); recomputing the full KV", self.request_id, error)
        self.stats.store_fallbacks += 1
        self.resident = self._recompute(self.tokens[:-1])
        self.feed = ResidentFeed(self.resident.to_full())

    # drafting
    def begin_window(self, x: int) -> None:
        self.x = x
        self.drafts, self.draft_probs = [], []
        self._draft_ctx = DraftKV(self.ckv)

    @property
    def drafting(self) -> bool:
        eos = self.drafts and self.drafts[-1] in self.cfg.eos_token_ids  # nothing after an end is committed
        return len(self.drafts) < self.x and not eos

    def draft_segment(self) -> Segment:
        token = self.drafts[-1] if self.drafts else self.tokens[-1]
        return Segment([token], [len(self.tokens) - 1 + len(self.drafts)], self._draft_ctx, logits="last")

    def take_draft(self, out: SegmentOutput) -> None:
        pos = len(self.tokens) + len(self.drafts)  # the drafted token's position
        if self.rejection:
            self.draft_probs.append(self.sampler.probs(out.logits)[0])
            token = int(self.sampler.sample(out.logits, [pos], STREAM_DRAFT)[0])
        else:
            token = int(self.sampler.sample(out.logits, [pos])[0])
        self.drafts.append(token)
        self.stats.decode_steps += 1

    # verification
    def verify_segment(self) -> Segment:
        n = len(self.tokens)
        return Segment([self.tokens[-1], *self.drafts], list(range(n - 1, n + len(self.drafts))),
                       StreamedKV(self.feed))

    def take_verify(self, out: SegmentOutput, timeline: Timeline | None = None,
                    timings: list[VerifyTiming] | None = None) -> Verdict:
        feed = self.feed
        feed.join()
        if timings is not None and timeline is not None:
            timings.append(VerifyTiming(getattr(feed, "started", None), list(feed.arrival), timeline.layer_start))
        stats = self.stats
        stats.verify_passes += 1
        stats.fetch_wait_s += feed.wait_s
        stats.fetch_bytes.append(feed.bytes_fetched)
        self.last_reload_bytes = getattr(feed, "bytes_moved", 0)
        n = len(self.tokens)
        positions = list(range(n - 1, n + len(self.drafts)))
        verdict = self._accept(out.logits, positions)
        j = len(verdict.tokens)  # inputs [0, j) were right: their K/V is exact
        exact = [(k[:, :j], v[:, :j]) for k, v in out.kv]
        for layer, (k, v) in enumerate(exact):
            self.compressor.update(self.ckv, layer, k, v, torch.tensor(positions[:j]))
        if self.resident is not None:
            self.resident.extend(exact)
        else:
            self.pending = (n - 1, exact)
        stats.drafted.append(len(self.drafts))
        stats.accepted.append(verdict.accepted)
        stats.committed.append(self._commit(verdict.tokens, out.logits[:j]))
        self.drafts, self.draft_probs, self._draft_ctx = [], [], None
        return verdict

    def _accept(self, logits: torch.Tensor, positions: list[int]) -> Verdict:
        token_positions = [p + 1 for p in positions]
        if self.rejection and self.drafts:
            return rejection_accept(self.drafts, torch.stack(self.draft_probs), self.sampler.probs(logits),
                                    token_positions, self.sampler)
        return greedy_accept(self.drafts, self.sampler.sample(logits, token_positions).tolist())

    def _commit(self, tokens: list[int], logits: torch.Tensor) -> int:
        taken = self.out.commit(tokens, logits)
        self.tokens.extend(tokens[:taken])
        self.kv.extend_tokens(tokens[:taken])
        return taken

    def release(self) -> None:
        if self.feed is not None:
            self.feed.join()
        self.stats.store_put_bytes = self.kv.stats.put_bytes
        self.kv.release()

    def result(self) -> GenerationResult:
        self.stats.decode_s = time.monotonic() - self.started
        self.stats.compressed_kv_bytes = self.ckv.nbytes
        self.stats.full_kv_bytes = self.full_kv_bytes()
        return self.out.result()
