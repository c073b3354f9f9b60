"""``full_kv: "store"`` in the worker: each request's exact K/V written to the full-KV store
(``remote_store``) as it becomes known, the prompt's at prefill, the committed tokens' after each
verification.

The device copy stays authoritative in this mode, so a store that fails only stops that request's
writes (logged, counted as "refused" or "outage"); nothing the server answers changes.
"""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING

from remote_store import refused

if TYPE_CHECKING:
    from vericache_sglang.core.kv import FullKV
    from vericache_sglang.full_kv.store import FullKVStore, RequestKV
    from vericache_sglang.sglang.metrics import WorkerMetrics

logger = logging.getLogger(__name__)


class RequestWrites:
    def __init__(self, store: FullKVStore, metrics: WorkerMetrics | None = None):
        """``store``: a ``vericache_sglang.full_kv.store.FullKVStore``; ``metrics``: the worker's, or None."""
        self.store, self.metrics = store, metrics
        self.handles: dict[str, RequestKV] = {}  # rid -> its RequestKV in the store, while writes succeed

    def open(self, rid: str, prompt_ids: list[int], full: FullKV) -> None:
        """A prefilled request: its prompt's K/V ``full`` (positions from 0)."""
        handle = self.store.open_request(prompt_ids, request_id=rid)
        self.handles[rid] = handle
        self._write(rid, handle, 0, full)

    def writing(self, rid: str) -> bool:
        return rid in self.handles

    def extend(self, rid: str, tokens: list[int], start: int, full: FullKV) -> None:
        """A verification committed ``tokens`` (the seed and the accepted drafts) at positions from
        ``start``, their exact K/V ``full``."""
        handle = self.handles.get(rid)
        if handle is not None:
            handle.extend_tokens(tokens)
            self._write(rid, handle, start, full)

    def release(self, rid: str) -> None:
        handle = self.handles.pop(rid, None)
        if handle is not None:
            with contextlib.suppress(Exception):
                handle.release()

    def _write(self, rid: str, handle: RequestKV, start: int, full: FullKV) -> None:
        try:
            handle.write(start, full.layers)
        except Exception as e:  # a store outage must not fail the step
            if refused(e):
                logger.error(
                    "VeriCache: the full-KV store refused this server's credentials (%s); request %s's KV "
                    "stays on the device only",
                    e,
                    rid,
                )
            else:
                logger.warning(
                    "VeriCache: full-KV store write for request %s failed (%s); its KV stays on the device only", rid, e
                )
            if self.metrics is not None:
                self.metrics.store_error("refused" if refused(e) else "outage")
            self.release(rid)
            return
        if self.metrics is not None:
            self.metrics.full_kv_written.inc(full.nbytes)
