"""The engine behind a server: one thread runs the batch engine's serve loop (prefill, staggered
drafting and verification of every admitted request); HTTP handlers submit requests and read
their events. Only verified tokens are ever put on a request's event queue: they come from the
engine's commit callback, which only a verification's verdict reaches."""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

from vericache_sglang.core.compress import Compressor, SpecError, parse_spec
from vericache_sglang.core.sampling import SamplingParams
from vericache_sglang.engine.batch import BatchConfig, BatchEngine
from vericache_sglang.engine.engine import Engine
from vericache_sglang.engine.generation import GenerationConfig, GenerationResult
from vericache_sglang.serve.metrics import Metrics


class ServeError(Exception):
    """A request the server refuses or could not serve, with its HTTP status."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param


@dataclass(frozen=True)
class Limits:
    max_prompt_tokens: int = 8192
    max_new_tokens: int = 2048
    max_concurrency: int = 16  # requests queued or running; more get 429
    max_horizon: int = 64


@dataclass
class Handle:
    """One request's events, in order: ("tokens", [ids]) ..., then ("done", result) or ("error", exc)."""

    id: str
    prompt_tokens: int
    compressor: str
    horizon: int
    events: queue.Queue = field(default_factory=queue.Queue)

    def stream(self, timeout_s: float | None = None) -> Iterator[tuple[str, object]]:
        while True:
            try:
                kind, value = self.events.get(timeout=timeout_s)
            except queue.Empty:
                raise ServeError(504, f"request {self.id}: no progress in {timeout_s} s", "timeout") from None
            yield kind, value
            if kind in ("done", "error"):
                return


@dataclass
class _Pending:
    handle: Handle
    tokens: list[int]
    gen: GenerationConfig
    compressor: Compressor


class EngineService:
    def __init__(self, engine: Engine, compressor: str = "snapkv:ratio=0.25", horizon: int = 16,
                 kv_budget_bytes: int = 4 << 30, limits: Limits | None = None, metrics: Metrics | None = None):
        self.engine = engine
        self.limits = limits or Limits()
        self.metrics = metrics or Metrics()
        self.default_compressor = parse_spec(compressor)
        self.default_horizon = horizon
        self.batch = BatchEngine(engine.runner, engine.store, self.default_compressor,
                                 BatchConfig(mode="vericache", schedule="staggered", kv_budget_bytes=kv_budget_bytes,
                                             max_running=self.limits.max_concurrency),
                                 engine.config(horizon=horizon), engine.tokenizer)
        self.batch.intake = self._intake
        self._pending: list[_Pending] = []
        self._lock = threading.Lock()
        self._in_flight = 0
        self._ids = itertools.count()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self.batch.serve, args=(self._stop,), name="vericache-engine",
                                            daemon=True)
            self._thread.start()

    def stop(self, timeout_s: float = 30.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def submit(self, tokens: list[int], *, max_new_tokens: int, sampling: SamplingParams,
               stop: tuple[str, ...] = (), compressor: str | None = None, horizon: int | None = None,
               adaptive_horizon: bool = False, logprobs: bool = False) -> Handle:
        """Check and queue one request; raise ServeError (4xx) for what cannot be served."""
        lim = self.limits
        if not tokens:
            raise ServeError(400, "the prompt is empty", param="prompt")
        vocab = self.engine.runner.vocab_size
        if any(not 0 <= t < vocab for t in tokens):
            raise ServeError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
        if len(tokens) > lim.max_prompt_tokens:
            raise ServeError(400, f"the prompt has {len(tokens)} tokens; this server takes at most "
                                  f"{lim.max_prompt_tokens}", param="prompt")
        if not 1 <= max_new_tokens <= lim.max_new_tokens:
            raise ServeError(400, f"max_tokens must be in [1, {lim.max_new_tokens}], got {max_new_tokens}",
                             param="max_tokens")
        if len(tokens) + max_new_tokens >= self.engine.runner.max_positions:
            raise ServeError(400, f"prompt ({len(tokens)}) plus max_tokens ({max_new_tokens}) exceed the model's "
                                  f"context of {self.engine.runner.max_positions}", param="max_tokens")
        x = self.default_horizon if horizon is None else horizon
        if not 1 <= x <= lim.max_horizon:
            raise ServeError(400, f"vericache.horizon must be in [1, {lim.max_horizon}], got {x}", param="vericache")
        try:
            comp = self.default_compressor if compressor is None else parse_spec(compressor)
        except SpecError as e:
            raise ServeError(400, f"vericache.compressor: {e}", param="vericache") from None
        try:
            gen = self.engine.config(max_new_tokens=max_new_tokens, sampling=sampling, stop_strings=stop,
                                     horizon=x, adaptive_horizon=adaptive_horizon, logprobs=logprobs)
        except ValueError as e:
            raise ServeError(400, str(e)) from None
        with self._lock:
            if self._in_flight >= lim.max_concurrency:
                self.metrics.failed("rejected")
                raise ServeError(429, f"{self._in_flight} requests in flight; the limit is {lim.max_concurrency}",
                                 "rate_limit_exceeded")
            self._in_flight += 1
            handle = Handle(f"cmpl-{next(self._ids)}", len(tokens), comp.spec, x)
            self._pending.append(_Pending(handle, list(tokens), gen, comp))
        self.metrics.running.set(self._in_flight)
        return handle

    def _intake(self) -> None:
        """Engine thread: prefill what arrived and hand it to the batch engine."""
        with self._lock:
            arrived, self._pending = self._pending, []
        for p in arrived:
            handle = p.handle
            try:
                pre = self.engine.prefill(p.tokens)
            except Exception as e:  # a prefill that fails fails its request only
                self._failed(handle, e)
                continue
            self.batch.submit(pre, handle.id, p.gen, p.compressor,
                              on_commit=lambda tokens, h=handle: h.events.put(("tokens", tokens)),
                              on_done=lambda result, h=handle: self._done(h, result),
                              on_error=lambda error, h=handle: self._failed(h, error))

    def _done(self, handle: Handle, result: GenerationResult) -> None:
        self.metrics.finished(result, handle.prompt_tokens)
        self._release()
        handle.events.put(("done", result))

    def _failed(self, handle: Handle, error: BaseException) -> None:
        self.metrics.failed("error")
        self._release()
        handle.events.put(("error", error))

    def _release(self) -> None:
        with self._lock:
            self._in_flight -= 1
        self.metrics.running.set(self._in_flight)
