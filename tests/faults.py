"""Fault injection around a real byte store (not a mock: every call reaches the real backend
until the injected failure)."""

from __future__ import annotations

from collections.abc import Sequence

from remote_store.backends.base import ByteStore, StoreError


class FaultInjectingStore(ByteStore):
    """Raises StoreError on get calls number ``fail_from`` .. ``fail_until`` (1-based, inclusive)."""

    def __init__(self, inner: ByteStore, fail_from: int, fail_until: int | None = None):
        self.inner = inner
        self.url = inner.url
        self.fail_from = fail_from
        self.fail_until = fail_until
        self.gets = 0
        self.failures = 0

    def put_many(self, items, ttl_s=None):
        self.inner.put_many(items, ttl_s)

    def get_many(self, keys: Sequence[str]):
        self.gets += 1
        if self.gets >= self.fail_from and (self.fail_until is None or self.gets <= self.fail_until):
            self.failures += 1
            raise StoreError(f"injected failure on get #{self.gets}")
        return self.inner.get_many(keys)

    def exists_many(self, keys):
        return self.inner.exists_many(keys)

    def delete_many(self, keys):
        return self.inner.delete_many(keys)

    def pin(self, keys):
        self.inner.pin(keys)

    def unpin(self, keys):
        self.inner.unpin(keys)

    def stats(self):
        return self.inner.stats()
