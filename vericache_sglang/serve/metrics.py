"""Prometheus metrics of a VeriCache server, in a registry of its own (one per app)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from vericache_sglang.engine.generation import GenerationResult
from vericache_sglang.metrics import STORE_ERROR_KINDS, STORE_ERRORS, STORE_ERRORS_HELP, StoreErrorKind


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("vericache_requests", "Requests by outcome", ["status"], registry=r)
        self.generated_tokens = Counter("vericache_generated_tokens", "Verified tokens returned", registry=r)
        self.prompt_tokens = Counter("vericache_prompt_tokens", "Prompt tokens received", registry=r)
        self.verify_passes = Counter("vericache_verify_passes", "Verification passes over the full KV", registry=r)
        self.accepted_length = Histogram(
            "vericache_accepted_length",
            "Tokens committed per verification",
            buckets=(1, 2, 4, 8, 16, 32, 64, 65),
            registry=r,
        )
        self.full_kv_bytes = Counter(
            "vericache_full_kv_fetched_bytes", "Full-KV bytes fetched from the store", registry=r
        )
        self.link_wait = Counter(
            "vericache_link_wait_seconds", "Time verifications waited for full-KV layers", registry=r
        )
        self._store_errors = Counter(STORE_ERRORS, STORE_ERRORS_HELP, ["kind"], registry=r)
        for kind in STORE_ERROR_KINDS:  # both series exist from the start, at 0
            self._store_errors.labels(kind=kind)
        self.decode_rate = Gauge(
            "vericache_decode_tokens_per_second", "Decode rate of the last finished request", registry=r
        )
        self.prefix_hits = Counter(
            "vericache_prefix_hits",
            "Requests started over a shared document's compressed copy (no prefill)",
            registry=r,
        )
        self.prefix_tokens = Counter(
            "vericache_prefix_tokens", "Prompt tokens served from shared documents", registry=r
        )
        self.documents = Gauge("vericache_documents", "Shared documents with a compressed copy here", registry=r)
        self.checks = Counter(
            "vericache_checks", "Requests also decoded with the full KV and compared, by result", ["result"], registry=r
        )
        self.running = Gauge("vericache_requests_in_flight", "Requests admitted and not finished", registry=r)

    def store_error(self, kind: StoreErrorKind, n: int = 1) -> None:
        self._store_errors.labels(kind=kind).inc(n)

    def finished(self, result: GenerationResult, prompt_tokens: int) -> None:
        s = result.stats
        self.requests.labels("ok").inc()
        self.generated_tokens.inc(len(result.tokens))
        self.prompt_tokens.inc(prompt_tokens)
        self.verify_passes.inc(s.verify_passes)
        for n in s.committed:
            self.accepted_length.observe(n)
        self.full_kv_bytes.inc(sum(s.fetch_bytes))
        self.link_wait.inc(s.fetch_wait_s)
        self.store_error("outage", s.store_fallbacks)
        self.decode_rate.set(result.tokens_per_second)

    def failed(self, status: str) -> None:
        self.requests.labels(status).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
