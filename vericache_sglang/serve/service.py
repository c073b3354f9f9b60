"""The engine behind a server: one thread runs the batch engine's serve loop (prefill, staggered
drafting and verification of every admitted request); HTTP handlers submit requests and read
their events. Only verified tokens are ever put on a request's event queue: they come from the
engine's commit callback, which only a verification's verdict reaches.

With a prefix registry, a prompt that starts with a registered document skips its prefill: it
drafts at once over the document's compressed copy. The registry follows the store's document
catalog (documents registered by any server or by ``vericache prefix add``), every few seconds,
on the engine thread, which is the only thread that runs the model.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field

from remote_store.backends.base import StoreError, refused
from vericache_sglang.core.compress import Compressor, SpecError, parse_spec
from vericache_sglang.core.sampling import SamplingParams
from vericache_sglang.engine.batch import BatchEngine
from vericache_sglang.engine.batch_jobs import BatchConfig
from vericache_sglang.engine.constraint import Constraint
from vericache_sglang.engine.decode import generate_full
from vericache_sglang.engine.engine import Engine, compare
from vericache_sglang.engine.generation import GenerationConfig, GenerationResult
from vericache_sglang.engine.prefix import PrefixRegistry, RegisteredPrefix
from vericache_sglang.serve.metrics import Metrics

log = logging.getLogger(__name__)


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
    prefix_tokens: int = 0  # the registered document it started with (no prefill for those)
    prefix_name: str | None = None
    check: dict[str, object] | None = None  # with ``check``: the comparison with full-KV decoding

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
    chosen: bool  # the request named its compressor (a document's copy is then not used)
    check: bool  # also decode with the full KV and compare (costs a full decode on the engine thread)
    prefix: RegisteredPrefix | None = None  # the document copy it started over, if any
    committed: int = 0


class EngineService:
    def __init__(
        self,
        engine: Engine,
        compressor: str = "snapkv:ratio=0.25",
        horizon: int = 16,
        kv_budget_bytes: int = 4 << 30,
        limits: Limits | None = None,
        metrics: Metrics | None = None,
        prefixes: PrefixRegistry | None = None,
        prefix_refresh_s: float = 2.0,
    ):
        self.engine = engine
        self.prefixes = prefixes
        self.prefix_refresh_s = prefix_refresh_s
        self._synced_at = float("-inf")
        self._ops: list[tuple[Callable[[], object], Future]] = []  # model work for the engine thread
        self.limits = limits or Limits()
        self.metrics = metrics or Metrics()
        self.default_compressor = parse_spec(compressor)
        self.default_horizon = horizon
        self.batch = BatchEngine(
            engine.runner,
            engine.store,
            self.default_compressor,
            BatchConfig(
                mode="vericache",
                schedule="staggered",
                kv_budget_bytes=kv_budget_bytes,
                max_running=self.limits.max_concurrency,
            ),
            engine.config(horizon=horizon),
            engine.tokenizer,
        )
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
            self._thread = threading.Thread(
                target=self.batch.serve, args=(self._stop,), name="vericache-engine", daemon=True
            )
            self._thread.start()

    def stop(self, timeout_s: float = 30.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def submit(
        self,
        tokens: list[int],
        *,
        max_new_tokens: int,
        sampling: SamplingParams,
        stop: tuple[str, ...] = (),
        compressor: str | None = None,
        horizon: int | None = None,
        adaptive_horizon: bool = False,
        logprobs: bool = False,
        check: bool = False,
        constraint: Constraint | None = None,
    ) -> Handle:
        """Check and queue one request; raise ServeError (4xx) for what cannot be served."""
        lim = self.limits
        if not tokens:
            raise ServeError(400, "the prompt is empty", param="prompt")
        vocab = self.engine.runner.vocab_size
        if any(not 0 <= t < vocab for t in tokens):
            raise ServeError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
        if len(tokens) > lim.max_prompt_tokens:
            raise ServeError(
                400,
                f"the prompt has {len(tokens)} tokens; this server takes at most {lim.max_prompt_tokens}",
                param="prompt",
            )
        if not 1 <= max_new_tokens <= lim.max_new_tokens:
            raise ServeError(
                400, f"max_tokens must be in [1, {lim.max_new_tokens}], got {max_new_tokens}", param="max_tokens"
            )
        if len(tokens) + max_new_tokens >= self.engine.runner.max_positions:
            raise ServeError(
                400,
                f"prompt ({len(tokens)}) plus max_tokens ({max_new_tokens}) exceed the model's "
                f"context of {self.engine.runner.max_positions}",
                param="max_tokens",
            )
        x = self.default_horizon if horizon is None else horizon
        if not 1 <= x <= lim.max_horizon:
            raise ServeError(400, f"vericache.horizon must be in [1, {lim.max_horizon}], got {x}", param="vericache")
        try:
            comp = self.default_compressor if compressor is None else parse_spec(compressor)
        except SpecError as e:
            raise ServeError(400, f"vericache.compressor: {e}", param="vericache") from None
        try:
            gen = self.engine.config(
                max_new_tokens=max_new_tokens,
                sampling=sampling,
                stop_strings=stop,
                horizon=x,
                adaptive_horizon=adaptive_horizon,
                logprobs=logprobs,
                keep_logits=check,
                constraint=constraint,
            )
        except ValueError as e:
            raise ServeError(400, str(e)) from None
        with self._lock:
            if self._in_flight >= lim.max_concurrency:
                self.metrics.failed("rejected")
                raise ServeError(
                    429,
                    f"{self._in_flight} requests in flight; the limit is {lim.max_concurrency}",
                    "rate_limit_exceeded",
                )
            self._in_flight += 1
            handle = Handle(f"cmpl-{next(self._ids)}", len(tokens), comp.spec, x)
            self._pending.append(_Pending(handle, list(tokens), gen, comp, compressor is not None, check))
        self.metrics.running.set(self._in_flight)
        return handle

    # shared documents
    def register_document(
        self, tokens: list[int], name: str | None = None, timeout_s: float = 600.0
    ) -> RegisteredPrefix:
        """Prefill a document on the engine thread, store its full KV, list it in the store's catalog."""
        if self.prefixes is None:
            raise ServeError(400, "this server has no prefix registry (start it with --prefix-compressor)")
        if not tokens:
            raise ServeError(400, "the document is empty", param="text")
        chunk = self.engine.store.chunk_tokens
        if len(tokens) < chunk:
            raise ServeError(
                400, f"a document needs at least one store chunk of {chunk} tokens; it has {len(tokens)}", param="text"
            )
        if len(tokens) > self.limits.max_prompt_tokens:
            raise ServeError(
                400,
                f"the document has {len(tokens)} tokens; this server takes at most {self.limits.max_prompt_tokens}",
                param="text",
            )
        try:
            return self._on_engine_thread(lambda: self.prefixes.register(tokens, name, publish=True), timeout_s)
        except StoreError as e:
            self.metrics.store_error("outage")
            raise ServeError(502, f"the store failed while registering the document: {e}", "server_error") from None
        except ValueError as e:
            raise ServeError(400, str(e)) from None

    def remove_document(self, digest: str, timeout_s: float = 60.0) -> bool:
        """Unlist a document from the store's catalog and drop this server's copy (other servers drop
        theirs at their next sync). Returns whether it was listed."""
        if self.prefixes is None:
            raise ServeError(400, "this server has no prefix registry (start it with --prefix-compressor)")

        def remove() -> bool:
            listed = self.prefixes.catalog.remove(digest)
            self.prefixes.by_digest.pop(digest, None)
            return listed

        try:
            return self._on_engine_thread(remove, timeout_s)
        except StoreError as e:
            self.metrics.store_error("outage")
            raise ServeError(502, f"the store failed while removing the document: {e}", "server_error") from None

    def documents(self) -> list[dict[str, object]]:
        """The documents this server holds a compressed copy of."""
        if self.prefixes is None:
            return []
        return [
            {
                "digest": p.digest,
                "name": p.name,
                "tokens": len(p.tokens),
                "compressor": p.compressor.spec,
                "compressed_kv_bytes": p.compressed_kv_bytes,
                "full_kv_bytes": p.full_kv_bytes,
                "hits": p.hits,
            }
            for p in self.prefixes.prefixes
        ]

    def _on_engine_thread(self, work: Callable[[], object], timeout_s: float) -> object:
        if not self.alive:
            raise ServeError(503, "the engine is not running", "server_error")
        done: Future = Future()
        with self._lock:
            self._ops.append((work, done))
        return done.result(timeout_s)

    def _sync_prefixes(self) -> None:
        if self.prefixes is None or time.monotonic() - self._synced_at < self.prefix_refresh_s:
            return
        self._synced_at = time.monotonic()
        try:
            adopted, dropped = self.prefixes.sync()
        except Exception as e:  # the store is down: keep the copies we have, try again later
            self.metrics.store_error("outage")
            log.warning("document catalog sync failed: %s", e)
            return
        for p in adopted:
            log.info("document %s (%d tokens) adopted in %.2f s", p.name, len(p.tokens), p.seconds)
        for digest in dropped:
            log.info("document %s unlisted: its compressed copy is dropped", digest)
        self.metrics.documents.set(len(self.prefixes.by_digest))

    def _intake(self) -> None:
        """Engine thread: run queued model work, follow the document catalog, prefill what arrived
        (or start it over a document's compressed copy) and hand it to the batch engine."""
        with self._lock:
            ops, self._ops = self._ops, []
        for work, done in ops:
            try:
                done.set_result(work())
            except Exception as e:
                done.set_exception(e)
        if ops and self.prefixes is not None:
            self.metrics.documents.set(len(self.prefixes.by_digest))
        self._sync_prefixes()
        with self._lock:
            arrived, self._pending = self._pending, []
        for p in arrived:
            handle = p.handle
            prefix = None if self.prefixes is None or p.chosen else self.prefixes.match(p.tokens)
            p.prefix = prefix
            if prefix is not None:
                handle.prefix_tokens, handle.prefix_name = len(prefix.tokens), prefix.name
                handle.compressor = prefix.compressor.spec
                prefix.hits += 1
                self.metrics.prefix_hits.inc()
                self.metrics.prefix_tokens.inc(len(prefix.tokens))
                try:
                    self.batch.submit_prefixed(p.tokens, prefix, handle.id, p.gen, **self._callbacks(p))
                except Exception as e:
                    self._failed(handle, e)
                continue
            try:
                pre = self.engine.prefill(p.tokens)
            except Exception as e:  # a prefill that fails fails its request only
                self._failed(handle, e)
                continue
            self.batch.submit(pre, handle.id, p.gen, p.compressor, **self._callbacks(p))

    def _callbacks(self, p: _Pending) -> dict[str, Callable]:
        handle = p.handle

        def commit(tokens: list[int]) -> None:
            p.committed += len(tokens)
            handle.events.put(("tokens", tokens))

        return {
            "on_commit": commit,
            "on_done": lambda result: self._done(handle, result, p if p.check else None),
            "on_error": lambda error: self._error(p, error),
        }

    def _error(self, p: _Pending, error: BaseException) -> None:
        """A request over a document whose full KV the store no longer serves starts again with a
        prefill, if it has not committed anything yet; anything else fails the request."""
        if p.prefix is not None and p.committed == 0 and isinstance(error, StoreError):
            log.warning(
                "request %s: document %s unavailable (%s); prefilling instead", p.handle.id, p.prefix.name, error
            )
            self.prefixes.by_digest.pop(p.prefix.digest, None)  # the next catalog sync adopts it again if it can
            self.metrics.store_error("outage")
            p.prefix, p.chosen = None, True
            p.handle.prefix_tokens, p.handle.prefix_name, p.handle.compressor = 0, None, p.compressor.spec
            with self._lock:
                self._pending.append(p)
            return
        self._failed(p.handle, error)

    def _check(self, p: _Pending, result: GenerationResult) -> dict[str, object]:
        """Engine thread: full-KV decoding of the same prompt, prefilled from scratch, compared."""
        ref = generate_full(self.engine.runner, self.engine.prefill(p.tokens, reuse_prefix=False), p.gen)
        cmp = compare(ref, result)
        self.metrics.checks.labels("identical" if cmp["identical"] else "mismatch").inc()
        return cmp

    def _done(self, handle: Handle, result: GenerationResult, check: _Pending | None = None) -> None:
        if check is not None:
            try:
                handle.check = self._check(check, result)
            except Exception as e:  # the output stands (it is verified); only the comparison failed
                handle.check = {"identical": None, "error": str(e)}
        self.metrics.finished(result, handle.prompt_tokens)
        self._release()
        handle.events.put(("done", result))

    def _failed(self, handle: Handle, error: BaseException) -> None:
        self.metrics.failed("error")
        if refused(error):
            self.metrics.store_error("refused")
            log.error("the full-KV store refused this server's credentials: %s", error)
        self._release()
        handle.events.put(("error", error))

    def _release(self) -> None:
        with self._lock:
            self._in_flight -= 1
        self.metrics.running.set(self._in_flight)
