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

from remote_store import refused
from vericache_sglang.core.accept import Verdict, greedy_accept, rejection_accept
from vericache_sglang.core.compress import Compressor
from vericache_sglang.core.drafting import DraftWindow
from vericache_sglang.core.horizon import AdaptiveHorizon, WindowCost
from vericache_sglang.core.kv import CompressedKV
from vericache_sglang.core.lookup import NgramIndex
from vericache_sglang.core.sampling import Sampler
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
from vericache_sglang.full_kv.store import FullKVStore

FIRST_ADAPTIVE_WINDOW = 16  # before any cost is measured
log = logging.getLogger(__name__)


class VeriCacheRequest:
    """A request's tokens are all committed (prompt and verified output); ``exact_upto`` of them have
    their exact K/V in the store. Normally that is all but the last; after a compressed prefix,
    the prompt's own tokens past it are committed but not yet exact: the first verification
    recomputes them along with the drafts (they were drafted over the compressed prefix)."""

    def __init__(
        self,
        runner: ModelRunner,
        pre: Prefill | None,
        compressor: Compressor,
        store: FullKVStore,
        cfg: GenerationConfig,
        tokenizer: object | None = None,
        on_commit: Callable[[list[int]], None] | None = None,
        request_id: str | None = None,
        recompute: Callable[[list[int]], ResidentKV] | None = None,
        *,
        prompt: list[int] | None = None,
        prefix_ckv: CompressedKV | None = None,
        prefix_len: int = 0,
        ckv: CompressedKV | None = None,
    ):
        self.runner = runner
        self.compressor = compressor
        self.cfg = cfg
        self.out = Output(f"vericache[{compressor.spec}]", cfg, tokenizer, on_commit)
        self.stats = self.out.stats
        self.sampler = Sampler(cfg.sampling)
        self.rejection = cfg.verify == "rejection" and not cfg.sampling.greedy
        self.started = time.monotonic()
        self.resident: ResidentKV | None = None  # the recompute fallback, once the store has failed
        self._recompute = recompute
        self.feed: FullKVFetch | ResidentFeed | None = None
        self.last_read_bytes = 0
        self.first_token_s: float | None = None  # time to the first committed token
        # With a constraint: the grammar's state after the committed tokens (the window walks it
        # along the drafts, the verification rolls it back and reuses each draft's mask).
        self.grammar = cfg.constraint.state() if cfg.constraint is not None else None
        self.window: DraftWindow | None = None  # the open draft window (core/drafting.py)
        self._draft_ctx: DraftKV | None = None
        self.lookup = compressor.lookup
        self.lookup_index: NgramIndex | None = None  # over the committed tokens, built below
        # Measured costs for the adaptive horizon (exponential averages): per draft step, per verify
        # pass (compute, fetch wait excluded), and the link's bytes per second.
        self.policy = AdaptiveHorizon(max_horizon=cfg.horizon) if cfg.adaptive_horizon else None
        self.draft_s: float | None = None
        self.verify_s: float | None = None
        self.link_bytes_s: float | None = None
        self._window_started = self._verify_started = 0.0
        self._window_steps = 0  # decode_steps when the window began
        if pre is not None:  # ``ckv``: the prompt's compressed KV, when the caller has made it already
            self.ckv = ckv if ckv is not None else compressor.compress(pre.kv, pre.obs)
            self.kv = store.open_request(pre.tokens, request_id)
            self.tokens = list(pre.tokens)
            self.exact_upto = len(self.tokens)
            self.pending: tuple[int, list] | None = (0, pre.kv.layers)  # written by the first fetch
            self.stats.prefill_s = pre.seconds
            logits = pre.logits[None] if self.grammar is None else self.grammar.apply(pre.logits[None])
            first = int(self.sampler.sample(logits, [len(self.tokens)])[0])
            self._commit([first], logits)
            if self.grammar is not None:
                self.grammar.advance(first)
        else:
            if prompt is None or prefix_ckv is None or not 0 < prefix_len < len(prompt):
                raise ValueError(
                    "a request without a prefill needs its prompt, a compressed prefix and its "
                    "length (shorter than the prompt)"
                )
            self.ckv = prefix_ckv  # the caller's copy: updates change it
            self.kv = store.open_request(prompt, request_id)
            self.kv.adopt_prefix(prefix_len)
            self.tokens = list(prompt)
            self.exact_upto = prefix_len
            self.pending = None
        self.request_id = self.kv.request_id
        if self.lookup is not None:
            self.lookup_index = NgramIndex(self.lookup)
            self.lookup_index.extend(self.tokens)

    @property
    def done(self) -> bool:
        return self.out.stop.done or len(self.tokens) >= self.runner.max_positions

    @property
    def context_tokens(self) -> int:
        """Positions whose exact KV exists (in the store, or resident after a fallback)."""
        return self.exact_upto

    def next_horizon(self, horizon: int | None = None) -> int:
        """The draft length for the next window: the horizon (or the adaptive policy's choice), cut
        so nothing past the end is drafted."""
        x = self.cfg.horizon if horizon is None else horizon
        if horizon is None and self.policy is not None:
            x = self._adaptive_horizon()
        return max(0, min(x, self.out.stop.remaining - 1, self.runner.max_positions - len(self.tokens) - 1))

    def window_cost(self) -> WindowCost | None:
        """The next window's cost from what was measured so far (None before the first window)."""
        if self.draft_s is None or self.verify_s is None:
            return None
        transfer = 0.0
        if self.resident is None and self.link_bytes_s:
            transfer = self.next_reload_bytes() / self.link_bytes_s
        return WindowCost(self.draft_s, self.verify_s, transfer)

    def _adaptive_horizon(self) -> int:
        cost = self.window_cost()
        if cost is None:
            return min(FIRST_ADAPTIVE_WINDOW, self.cfg.horizon)
        return self.policy.choose(self.stats.drafted, self.stats.accepted, cost)

    @staticmethod
    def _ema(old: float | None, new: float) -> float:
        return new if old is None else 0.5 * old + 0.5 * new

    def full_kv_bytes(self) -> int:
        return self.context_tokens * self.runner.layout.bytes_per_token

    def next_reload_bytes(self) -> int:
        """What the next fetch puts on the link: the pending commit it writes first, then the read
        (as much as the last one moved, or the whole full KV before any was measured)."""
        per_token = self.runner.layout.bytes_per_token
        write = 0 if self.pending is None else self.pending[1][0][0].shape[1] * per_token
        return max(1, write + (self.last_read_bytes or self.full_kv_bytes()))

    # fetch
    def start_fetch(self) -> None:
        if self.resident is not None:
            self.feed = ResidentFeed.of_resident(self.resident)
        else:
            # The rows the compressed KV holds bit-exactly need not cross the link again.
            # Room for the verify pass's tokens: the committed ones the store lacks, then the drafts.
            room = len(self.tokens) - self.exact_upto + self.cfg.horizon
            self.feed = FullKVFetch(
                self.kv,
                self.exact_upto,
                self.runner.layout.num_layers,
                self.pending,
                self.cfg.fetch_timeout_s,
                held=lambda layer: self.ckv.layers[layer].exact_kv(),
                device=self.runner.device,
                room=room,
            )
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
        """A fetch failed: fail the request (nothing unverified was emitted) or recompute the full KV.
        A store that refused this server's credentials fails it whatever the setting: recomputing
        would hide a misconfiguration behind every request from then on."""
        self.feed.join()
        if refused(error):
            raise FetchError(
                f"verification failed, no unverified token emitted: the store refused this server: {error}"
            ) from error
        if self.cfg.on_store_error == "fail":
            raise FetchError(f"verification failed, no unverified token emitted: {error}") from error
        log.warning("request %s: full-KV fetch failed (%s); recomputing the full KV", self.request_id, error)
        self.stats.store_fallbacks += 1
        self.resident = self._recompute(self.tokens[: self.exact_upto])
        self.feed = ResidentFeed.of_resident(self.resident)

    # drafting: the compressed KV's model, composed with prompt-lookup chains (core/drafting.py)
    def begin_window(self, x: int) -> None:
        self._window_started = time.monotonic()
        self._window_steps = self.stats.decode_steps
        self._draft_ctx = DraftKV(self.ckv)
        # the committed tokens the window's KV lacks yet are its first inputs
        self.window = DraftWindow(
            x,
            len(self.tokens),
            self.tokens[self.exact_upto :],
            self.sampler,
            self.rejection,
            self.cfg.eos_token_ids,
            self.runner.vocab_size,
            self._draft_ctx.forget,
            self.lookup,
            self.lookup_index,
            self.grammar,
            self.runner.device,
        )

    @property
    def drafts(self) -> list[int]:
        return [] if self.window is None else self.window.drafts

    @property
    def drafting(self) -> bool:
        """Whether the window needs another draft forward."""
        return self.window is not None and self.window.drafting

    def draft_segment(self) -> Segment:
        """The inputs the window's KV lacks: the committed tokens without exact KV (at the window's
        start), the last model draft, or a lookup chain (whose every row the model checks)."""
        w = self.window
        return Segment(
            list(w.pending),
            list(range(w.position, w.position + len(w.pending))),
            self._draft_ctx,
            logits="all" if w.chain else "last",
        )

    def take_draft(self, out: SegmentOutput) -> None:
        self.stats.decode_steps += 1
        self.window.take(out.logits)

    # verification
    def verify_segment(self) -> Segment:
        if self.window is None:  # verified without a window (nothing drafted)
            self.begin_window(0)
        self._verify_started = time.monotonic()
        if self.drafts:
            self.draft_s = self._ema(self.draft_s, (self._verify_started - self._window_started) / len(self.drafts))
        inputs = [*self.tokens[self.exact_upto :], *self.drafts]
        return Segment(
            inputs,
            list(range(self.exact_upto, self.exact_upto + len(inputs))),
            StreamedKV(self.feed),
            keep_queries=len(inputs) if self.compressor.update_queries else 0,
        )

    def take_verify(
        self, out: SegmentOutput, timeline: Timeline | None = None, timings: list[VerifyTiming] | None = None
    ) -> Verdict:
        feed = self.feed
        feed.join()
        if timings is not None and timeline is not None:
            timings.append(VerifyTiming(getattr(feed, "started", None), list(feed.arrival), timeline.layer_start))
        stats = self.stats
        stats.verify_passes += 1
        stats.fetch_wait_s += feed.wait_s
        self._measure(feed)
        stats.fetch_bytes.append(feed.bytes_fetched)
        self.last_read_bytes = feed.bytes_fetched
        n, q = len(self.tokens), len(self.tokens) - self.exact_upto
        logits = out.logits[q - 1 :]  # the rows that predict positions n, n + 1, ...
        if self.grammar is not None:
            logits = self._constrained(logits)
        verdict = self._accept(logits, list(range(n - 1, n + len(self.drafts))))
        taken = self._commit(verdict.tokens, logits[: len(verdict.tokens)])
        if self.grammar is not None:
            for token in verdict.tokens[:taken]:
                self.grammar.advance(token)
        # Inputs whose K/V is now exact and committed: the q committed inputs, then the drafts up to
        # (not including) the last committed token, which is the next input.
        m = q + taken - 1
        exact = [(k[:, :m], v[:, :m]) for k, v in out.kv]
        positions = torch.arange(self.exact_upto, self.exact_upto + m)
        queries = None if out.queries is None else [q[:, :m] for q in out.queries]
        self.compressor.commit(self.ckv, exact, positions, queries)
        if self.compressor.refreshes and m:  # rows re-chosen by the committed tokens' attention
            self.compressor.refresh(self.ckv, [[feed.wait_layer(layer), kv] for layer, kv in enumerate(exact)], queries)
        if self.resident is not None:
            self.resident.extend(exact)
        else:
            self.pending = (self.exact_upto, exact)
        self.exact_upto += m
        stats.drafted.append(len(self.drafts))
        stats.accepted.append(verdict.accepted)
        stats.committed.append(taken)
        stats.draft_forwards.append(stats.decode_steps - self._window_steps)
        stats.lookup_drafted += self.window.sources.count("lookup")
        stats.lookup_accepted += self.window.sources[: verdict.accepted].count("lookup")
        self.window, self._draft_ctx = None, None
        return verdict

    def _constrained(self, logits: torch.Tensor) -> torch.Tensor:
        """The verification rows masked as full-KV constrained decoding masks them: each draft's
        position by the mask drafting used there, the bonus position by the state after every
        draft; then the grammar goes back to the committed state."""
        k = len(self.drafts)
        masks = list(self.window.draft_masks)
        if not self.grammar.terminated and not self.window.grammar_halted:
            masks.append(self.grammar.mask())
        self.grammar.rollback(self.window.grammar_walked)
        self.window.grammar_walked = 0
        rows = logits[: k + 1].float().clone()
        if masks:
            rows[: len(masks)] = self.grammar.apply(rows[: len(masks)], torch.cat(masks))
        return rows

    def _measure(self, feed: FullKVFetch | ResidentFeed) -> None:
        now = time.monotonic()
        if self._verify_started:
            self.verify_s = self._ema(self.verify_s, max(0.0, now - self._verify_started - feed.wait_s))
        started, last = getattr(feed, "started", None), feed.arrival[-1] if feed.arrival else None
        if started is not None and last is not None and last > started and feed.bytes_fetched:
            self.link_bytes_s = self._ema(self.link_bytes_s, feed.bytes_fetched / (last - started))

    def _accept(self, logits: torch.Tensor, positions: list[int]) -> Verdict:
        token_positions = [p + 1 for p in positions]
        if self.rejection and self.drafts:
            return rejection_accept(
                self.drafts,
                torch.stack(self.window.draft_probs),
                self.sampler.probs(logits),
                token_positions,
                self.sampler,
            )
        return greedy_accept(self.drafts, self.sampler.sample(logits, token_positions).tolist())

    def _commit(self, tokens: list[int], logits: torch.Tensor) -> int:
        taken = self.out.commit(tokens, logits)
        if self.first_token_s is None and taken:
            self.first_token_s = time.monotonic() - self.started
        self.tokens.extend(tokens[:taken])
        self.kv.extend_tokens(tokens[:taken])
        if self.lookup_index is not None:
            self.lookup_index.extend(tokens[:taken])
        return taken

    def release(self) -> None:
        if self.feed is not None:
            self.feed.join()
            self.feed = None  # its full KV goes now, not when the request object does
        self.stats.store_put_bytes = self.kv.stats.put_bytes
        self.kv.release()

    def result(self) -> GenerationResult:
        self.stats.decode_s = time.monotonic() - self.started
        self.stats.compressed_kv_bytes = self.ckv.nbytes
        self.stats.full_kv_bytes = self.full_kv_bytes()
        return self.out.result()
