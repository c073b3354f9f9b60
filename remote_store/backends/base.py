"""The byte-level store every backend implements: records by key, batched, with pins and TTLs."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence

RangeRequest = tuple[str, Sequence[tuple[int, int]]]  # a key and (offset, length) slices of its record


class StoreError(RuntimeError):
    """The store failed: unreachable, refused, out of space, or timed out."""


class StoreConfigError(StoreError):
    """The store cannot be used as configured, and trying again will not change that: it refused
    this client's credentials (wrong or missing), the TLS settings do not match, or (at start) its
    address does not answer. An outage is a plain StoreError; this one stops what asked."""


def refused(error: BaseException | None) -> bool:
    """Whether ``error`` is, or was caused by, a store refusing this client (``StoreConfigError``)."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, StoreConfigError):
            return True
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return False


PROBE_KEY = "vericache:probe"  # looked up (never written) to check a store answers and admits this client


class ByteStore(ABC):
    """Records (bytes) by string key. Batched calls; a backend pipelines them where it can."""

    url: str = ""

    @abstractmethod
    def put_many(self, items: Sequence[tuple[str, bytes]], ttl_s: float | None = None) -> None:
        """Store every record or raise StoreError. ``ttl_s``: collect them after that many seconds."""

    @abstractmethod
    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        """Records in key order; None for a missing key."""

    @abstractmethod
    def delete_many(self, keys: Sequence[str]) -> int:
        """Delete; return how many existed."""

    def stream_get(self, groups: Sequence[Sequence[str]]) -> Iterator[list[bytes | None]]:
        """Records group by group (one group per layer), each yielded as soon as it is complete.

        A backend that can stream (gRPC) keeps one request in flight for all groups.
        """
        for group in groups:
            yield self.get_many(group)

    def get_ranges(self, requests: Sequence[RangeRequest]) -> list[list[bytes] | None]:
        """For each ``(key, [(offset, length), ...])``, those byte slices of the record, or None when
        the key is missing. Backends that can read slices remotely move only those bytes; this
        default reads whole records."""
        records = self.get_many([key for key, _ in requests])
        return [
            None if r is None else [r[o : o + n] for o, n in ranges]
            for r, (_, ranges) in zip(records, requests, strict=True)
        ]

    def stream_get_ranges(self, groups: Sequence[Sequence[RangeRequest]]) -> Iterator[list[list[bytes] | None]]:
        """``get_ranges`` group by group (one group per layer), each yielded when complete."""
        for group in groups:
            yield self.get_ranges(group)

    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        return [r is not None for r in self.get_many(keys)]

    def probe(self) -> None:
        """One authenticated round trip (an existence check of ``PROBE_KEY``); raises StoreError."""
        self.exists_many([PROBE_KEY])

    def pin(self, keys: Sequence[str]) -> None:
        """Protect keys from eviction until unpinned (counted: pin twice, unpin twice)."""

    def unpin(self, keys: Sequence[str]) -> None:
        """Release pins taken by ``pin``."""

    @abstractmethod
    def stats(self) -> dict[str, object]:
        """At least: keys, bytes, capacity_bytes (0: unbounded), hits, misses, evictions."""

    def close(self) -> None:
        """Release connections."""
