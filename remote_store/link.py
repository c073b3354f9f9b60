"""A link emulator around any backend: real bytes move and are checked; only the remainder of the
emulated transfer time is slept.

The link is serial, as a PCIe lane or a NIC is: concurrent transfers queue behind each other.
Bandwidth is meant to be set by ratio to the engine's own memory bandwidth (the project's rule:
what decides VeriCache's gain is device-memory bandwidth over link bandwidth, not GB/s).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence

from remote_store.backends.base import ByteStore, RangeRequest


class LinkEmulator(ByteStore):
    def __init__(self, inner: ByteStore, bandwidth_bytes_s: float, latency_s: float = 0.0, ratio: float | None = None):
        if bandwidth_bytes_s <= 0:
            raise ValueError(f"link bandwidth must be > 0, got {bandwidth_bytes_s}")
        self.inner = inner
        self.url = inner.url
        self.bandwidth_bytes_s = bandwidth_bytes_s
        self.latency_s = latency_s
        self.ratio = ratio  # device-memory bandwidth / link bandwidth, when set that way
        self._busy_until = 0.0
        self._lock = threading.Lock()
        self.bytes_moved = 0
        self.transfer_s = 0.0  # emulated link time spent

    def _transfer(self, nbytes: int, started: float) -> None:
        duration = self.latency_s + nbytes / self.bandwidth_bytes_s
        with self._lock:
            begin = max(started, self._busy_until)
            end = begin + duration
            self._busy_until = end
            self.bytes_moved += nbytes
            self.transfer_s += duration
        delay = end - time.monotonic()
        if delay > 0:
            time.sleep(delay)

    def put_many(self, items: Sequence[tuple[str, bytes]], ttl_s: float | None = None) -> None:
        started = time.monotonic()
        self.inner.put_many(items, ttl_s)
        self._transfer(sum(len(v) for _, v in items), started)

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        started = time.monotonic()
        out = self.inner.get_many(keys)
        self._transfer(_record_bytes(out), started)
        return out

    def stream_get(self, groups: Sequence[Sequence[str]]) -> Iterator[list[bytes | None]]:
        # One streamed read: the link moves group after group while the reader decodes the last (a
        # DMA engine or a server stream does not wait for it), so every group's transfer is booked
        # from the stream's start, behind whatever the link carried before; the reader sleeps only
        # where it has caught up with the link.
        started = time.monotonic()
        for out in self.inner.stream_get(groups):
            self._transfer(_record_bytes(out), started)
            yield out

    def stream_get_ranges(self, groups: Sequence[Sequence[RangeRequest]]) -> Iterator[list[list[bytes] | None]]:
        started = time.monotonic()
        for out in self.inner.stream_get_ranges(groups):
            self._transfer(_range_bytes(out), started)
            yield out

    def get_ranges(self, requests: Sequence[RangeRequest]) -> list[list[bytes] | None]:
        started = time.monotonic()
        out = self.inner.get_ranges(requests)
        self._transfer(_range_bytes(out), started)
        return out

    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        return self.inner.exists_many(keys)

    def probe(self) -> None:
        self.inner.probe()

    def delete_many(self, keys: Sequence[str]) -> int:
        return self.inner.delete_many(keys)

    def pin(self, keys: Sequence[str]) -> None:
        self.inner.pin(keys)

    def unpin(self, keys: Sequence[str]) -> None:
        self.inner.unpin(keys)

    def stats(self) -> dict[str, object]:
        return {
            **self.inner.stats(),
            "link_bandwidth_bytes_s": self.bandwidth_bytes_s,
            "link_bytes_moved": self.bytes_moved,
            "link_transfer_s": self.transfer_s,
            **({"link_ratio": self.ratio} if self.ratio else {}),
        }

    def close(self) -> None:
        self.inner.close()


def _record_bytes(records: list[bytes | None]) -> int:
    return sum(len(r) for r in records if r is not None)


def _range_bytes(replies: list[list[bytes] | None]) -> int:
    return sum(len(part) for parts in replies if parts is not None for part in parts)
