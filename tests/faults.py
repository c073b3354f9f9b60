"""Fault injection around a real byte store. Not a mock: every call reaches the real backend; the
hook runs before each get, and may break the backend for real (kill its server) or raise."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from remote_store.backends.base import ByteStore, StoreError


class HookedStore(ByteStore):
    """Calls ``before_get(n)`` before the n-th get (1-based); fetches go one layer per get."""

    def __init__(self, inner: ByteStore, before_get: Callable[[int], None]):
        self.inner = inner
        self.url = inner.url
        self.before_get = before_get
        self.gets = 0

    def put_many(self, items, ttl_s=None):
        self.inner.put_many(items, ttl_s)

    def get_many(self, keys: Sequence[str]):
        self.gets += 1
        self.before_get(self.gets)
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


def failing_from(n: int, until: int | None = None) -> Callable[[int], None]:
    """A hook that raises StoreError on gets ``n`` .. ``until``."""

    def hook(count: int) -> None:
        if count >= n and (until is None or count <= until):
            raise StoreError(f"injected failure on get #{count}")

    return hook
