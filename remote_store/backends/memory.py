"""``memory://``: the embedded store, a byte-capacity LRU with pins (leases) and TTLs, safe across
threads."""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence

from remote_store.backends.base import ByteStore, RangeRequest, StoreError

# A pin is a lease: a holder that never unpins (a client that died, an unpin lost with its
# connection) must not keep records from eviction forever. Redis's pins expire alike.
DEFAULT_PIN_TTL_S = 3600.0


def default_capacity_bytes() -> int:
    """``memory://``'s capacity when the URL names none: a quarter of the host's memory. The store
    keeps every prompt's shared chunks for reuse (no TTL), so a long-running server without a bound
    would grow with every distinct prompt; beyond it, unpinned records go least recently used first."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4


class MemoryStore(ByteStore):
    def __init__(self, capacity_bytes: int = 0, url: str = "memory://", pin_ttl_s: float = DEFAULT_PIN_TTL_S):
        if capacity_bytes < 0 or pin_ttl_s <= 0:
            raise ValueError(f"capacity_bytes must be >= 0 and pin_ttl_s > 0, got {capacity_bytes}, {pin_ttl_s}")
        self.url = url
        self.capacity_bytes = capacity_bytes  # 0: unbounded
        self.pin_ttl_s = pin_ttl_s
        self._data: OrderedDict[str, tuple[bytes, float | None]] = OrderedDict()
        self._pins: dict[str, tuple[int, float]] = {}  # key -> (count, lease expiry); each pin renews it
        self._bytes = 0
        self._lock = threading.Lock()
        self._counters = {"hits": 0, "misses": 0, "evictions": 0, "expired": 0, "puts": 0, "pins_expired": 0}
        self._last_collect = 0.0

    def _pinned(self, key: str, now: float) -> bool:
        pin = self._pins.get(key)
        if pin is None:
            return False
        if pin[1] <= now:  # the lease ran out: its holders are gone
            del self._pins[key]
            self._counters["pins_expired"] += 1
            return False
        return True

    def _drop(self, key: str) -> None:
        value, _ = self._data.pop(key)
        self._bytes -= len(value)

    def _live(self, key: str, now: float) -> bytes | None:
        entry = self._data.get(key)
        if entry is None:
            return None
        value, expiry = entry
        if expiry is not None and expiry <= now and not self._pinned(key, now):
            self._drop(key)
            self._counters["expired"] += 1
            return None
        return value

    def _make_room(self, need: int, now: float) -> None:
        if not self.capacity_bytes:
            return
        if need > self.capacity_bytes:
            raise StoreError(f"record of {need} bytes exceeds the store capacity {self.capacity_bytes}")
        if self._bytes + need <= self.capacity_bytes:
            return
        victims = iter([k for k in self._data if not self._pinned(k, now)])
        while self._bytes + need > self.capacity_bytes:
            victim = next(victims, None)
            if victim is None:
                raise StoreError(f"store full: {self._bytes} of {self.capacity_bytes} bytes held and the rest pinned")
            self._drop(victim)
            self._counters["evictions"] += 1

    def put_many(self, items: Sequence[tuple[str, bytes]], ttl_s: float | None = None) -> None:
        now = time.monotonic()
        expiry = None if ttl_s is None else now + ttl_s
        with self._lock:
            self._collect(now)
            for key, value in items:
                if key in self._data:
                    self._drop(key)
                self._make_room(len(value), now)
                self._data[key] = (bytes(value), expiry)
                self._bytes += len(value)
                self._counters["puts"] += 1

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        now = time.monotonic()
        out = []
        with self._lock:
            for key in keys:
                value = self._live(key, now)
                if value is None:
                    self._counters["misses"] += 1
                else:
                    self._data.move_to_end(key)
                    self._counters["hits"] += 1
                out.append(value)
        return out

    def get_ranges(self, requests: Sequence[RangeRequest]) -> list[list[bytes] | None]:
        now = time.monotonic()
        out: list[list[bytes] | None] = []
        with self._lock:
            for key, ranges in requests:
                value = self._live(key, now)
                if value is None:
                    self._counters["misses"] += 1
                    out.append(None)
                    continue
                self._data.move_to_end(key)
                self._counters["hits"] += 1
                out.append([value[o : o + n] for o, n in ranges])
        return out

    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        now = time.monotonic()
        with self._lock:
            return [self._live(k, now) is not None for k in keys]

    def delete_many(self, keys: Sequence[str]) -> int:
        with self._lock:
            n = 0
            for key in keys:
                if key in self._data:
                    self._drop(key)
                    n += 1
            return n

    def pin(self, keys: Sequence[str]) -> None:
        now = time.monotonic()
        with self._lock:
            for key in keys:
                count = self._pins[key][0] if self._pinned(key, now) else 0
                self._pins[key] = (count + 1, now + self.pin_ttl_s)

    def unpin(self, keys: Sequence[str]) -> None:
        now = time.monotonic()
        with self._lock:
            for key in keys:
                if not self._pinned(key, now):
                    continue
                count, expiry = self._pins[key]
                if count > 1:
                    self._pins[key] = (count - 1, expiry)
                else:
                    del self._pins[key]

    def _collect(self, now: float) -> None:
        if now - self._last_collect < 1.0:
            return
        self._last_collect = now
        expired = [
            k for k, (_, exp) in self._data.items() if exp is not None and exp <= now and not self._pinned(k, now)
        ]
        for key in expired:
            self._drop(key)
        self._counters["expired"] += len(expired)
        for key in list(self._pins):  # lapsed pins of keys deleted or never read again go too
            self._pinned(key, now)

    def stats(self) -> dict[str, object]:
        now = time.monotonic()
        with self._lock:
            pinned = sum(self._pinned(k, now) for k in list(self._pins))
            return {
                "keys": len(self._data),
                "bytes": self._bytes,
                "capacity_bytes": self.capacity_bytes,
                "pinned_keys": pinned,
                **self._counters,
            }
