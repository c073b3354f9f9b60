"""The full-KV tier: a byte store chosen by URL, and the engine's chunked view of it."""

from __future__ import annotations

from urllib.parse import parse_qs, urlsplit

from remote_store.backends.base import ByteStore, StoreError
from remote_store.codec import ChunkError

__all__ = ["ByteStore", "ChunkError", "StoreError", "open_store"]

SCHEMES = ("memory",)


def open_store(url: str) -> ByteStore:
    """Open a byte store: ``memory://[?capacity_bytes=N]`` (the embedded default)."""
    parts = urlsplit(url)
    query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
    if parts.scheme == "memory":
        from remote_store.backends.memory import MemoryStore

        return MemoryStore(int(query.get("capacity_bytes", 0)), url=url)
    raise ValueError(f"unknown store URL {url!r}; supported schemes: {', '.join(s + '://' for s in SCHEMES)}")
