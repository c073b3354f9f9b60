"""VeriCache's metrics inside SGLang's scheduler processes.

SGLang runs prometheus_client in multiprocess mode (``PROMETHEUS_MULTIPROC_DIR``, set before its
processes start) and serves every process's samples at its own ``/metrics`` with ``--enable-metrics``.
Metrics made here, in the scheduler process that runs the VeriCache worker, therefore appear there
next to ``sglang:*`` ones, under the names ``vericache serve`` uses (``vericache_*``), labelled like
SGLang's (``model_name``, ``tp_rank``). Nothing is created without ``--enable-metrics``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vericache_sglang.metrics import STORE_ERROR_KINDS, STORE_ERRORS, STORE_ERRORS_HELP, StoreErrorKind

if TYPE_CHECKING:
    from sglang.srt.server_args import ServerArgs

ACCEPTED_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 65)


def metrics_enabled(server_args: ServerArgs) -> bool:
    """Whether the server was started with ``--enable-metrics`` (0.5.23 keeps it in its runtime context)."""
    try:
        from sglang.srt.runtime_context import get_observability

        return bool(get_observability().enable_metrics)
    except (ImportError, AttributeError, KeyError, RuntimeError):
        return bool(getattr(server_args, "enable_metrics", False))


class WorkerMetrics:
    def __init__(self, labels: dict[str, str]):
        # imported here: prometheus_client must see PROMETHEUS_MULTIPROC_DIR, which SGLang sets at launch
        from prometheus_client import Counter, Gauge, Histogram

        names = list(labels)
        self.labels = labels
        self.verify_passes = Counter("vericache_verify_passes", "Verification passes over the full KV", names).labels(
            **labels
        )
        self.drafted = Counter("vericache_drafted_tokens", "Tokens drafted over the compressed KV", names).labels(
            **labels
        )
        self.generated = Counter("vericache_generated_tokens", "Verified tokens committed", names).labels(**labels)
        self.accepted_length = Histogram(
            "vericache_accepted_length", "Tokens committed per verification", names, buckets=ACCEPTED_BUCKETS
        ).labels(**labels)
        self.full_kv_written = Counter(
            "vericache_full_kv_written_bytes", "Full-KV bytes written to the store or the host tier", names
        ).labels(**labels)
        # Reloads for verification (full_kv "host" or "store"). The link wait stays at 0 in the worker: the
        # verify pass waits per layer on the device's stream, which the host cannot time without
        # a synchronisation; defined so the series exist under the names `vericache serve` uses.
        self.full_kv_fetched = Counter(
            "vericache_full_kv_fetched_bytes", "Full-KV bytes fetched from the store or the host tier", names
        ).labels(**labels)
        self.fetch_seconds = Counter(
            "vericache_full_kv_fetch_seconds",
            "Time spent fetching verifications' full KV from the store (on the fetch thread)",
            names,
        ).labels(**labels)
        self.link_wait = Counter(
            "vericache_link_wait_seconds",
            "Time verify passes waited for full-KV layers still arriving from the store (the fetch time "
            "drafting did not hide)",
            names,
        ).labels(**labels)
        self.verify_passes_rerun = Counter(
            "vericache_verify_passes_rerun",
            "Verify passes run again: a fetch they read per layer failed mid-pass, its positions recomputed",
            names,
        ).labels(**labels)
        self.full_kv_recomputes = Counter(
            "vericache_full_kv_recomputes",
            "Verifications whose full KV the store did not deliver, recomputed from the committed tokens",
            names,
        ).labels(**labels)
        self.store_prefix_hits = Counter(
            "vericache_store_prefix_hits", "Prompts whose prefix was loaded from the full-KV store, not computed", names
        ).labels(**labels)
        self.store_prefix_tokens = Counter(
            "vericache_store_prefix_tokens", "Prompt tokens loaded from the full-KV store, not computed", names
        ).labels(**labels)
        self.store_prefix_fallbacks = Counter(
            "vericache_store_prefix_fallbacks",
            "Stored prompt prefixes that did not load (store down, record missing or bad), computed instead",
            names,
        ).labels(**labels)
        self.prefixes_streamed = Counter(
            "vericache_store_prefixes_streamed",
            "Requests whose cached prompt prefix left the device with their full KV, fetched for each verification",
            names,
        ).labels(**labels)
        self.prefix_copies_made = Counter(
            "vericache_prefix_copies_made", "Compressed copies made of cached prefixes", names
        ).labels(**labels)
        self.prefix_copy_hits = Counter(
            "vericache_prefix_copy_hits", "Requests that drafted over a cached prefix's existing compressed copy", names
        ).labels(**labels)
        self.draft_passes = Counter(
            "vericache_draft_passes",
            "Draft forward passes over the compressed KV (each "
            "serves the whole batch; with +lookup one checks a whole chain)",
            names,
        ).labels(**labels)
        self.lookup_drafted = Counter(
            "vericache_lookup_drafted_tokens", "Drafts copied by prompt lookup (+lookup)", names
        ).labels(**labels)
        self.refreshes = Counter(
            "vericache_refreshes", "Compressed-KV refreshes from a verification's attention (+refresh)", names
        ).labels(**labels)
        # labelled by the backend class that ran them: a triton/flashinfer server's masked verify,
        # or the plugin's chain backend on torch_native (lookup chains' checks included)
        self._target_verify_forwards = Counter(
            "vericache_target_verify_forwards",
            "TARGET_VERIFY forward passes (verifications, recomputes, lookup chains' checks) by attention backend",
            [*names, "backend"],
        )
        self._store_errors = Counter(STORE_ERRORS, STORE_ERRORS_HELP, [*names, "kind"])
        for kind in STORE_ERROR_KINDS:  # both series exist from the start, at 0
            self._store_errors.labels(**labels, kind=kind)
        self.compressed_kv = Gauge(
            "vericache_compressed_kv_bytes", "Compressed KV held for drafting", names, multiprocess_mode="livesum"
        ).labels(**labels)
        self.verify_seconds = Histogram(
            "vericache_step_seconds",
            "Draft-and-verify step time",
            names,
            buckets=(0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2),
        ).labels(**labels)

    def target_verify_forwards(self, by_backend: dict[str, int]) -> None:
        for backend, n in by_backend.items():
            self._target_verify_forwards.labels(**self.labels, backend=backend).inc(n)

    def store_error(self, kind: StoreErrorKind) -> None:
        self._store_errors.labels(**self.labels, kind=kind).inc()

    def verified(self, accepted: list[int], drafted: list[int], seconds: float, undrafted: int = 0) -> None:
        """One draft-and-verify step: drafting request i drafted ``drafted[i]`` tokens and had
        ``accepted[i]`` accepted (it commits one more); ``undrafted`` requests verified one token
        without drafts."""
        self.verify_passes.inc(len(accepted) + undrafted)
        self.drafted.inc(sum(drafted))
        self.generated.inc(sum(accepted) + len(accepted) + undrafted)
        for a in accepted:
            self.accepted_length.observe(a + 1)
        self.verify_seconds.observe(seconds)
