"""The full-KV tier: a byte store chosen by URL, and the engine's chunked view of it."""

from __future__ import annotations

from collections.abc import Callable
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from remote_store.backends.base import ByteStore, StoreError
from remote_store.codec import ChunkError

__all__ = ["ByteStore", "ChunkError", "StoreError", "open_store"]

SCHEMES = ("memory", "redis", "rediss", "grpc", "grpcs", "lmcache")
# Link-emulator parameters, accepted on any URL and stripped before the backend sees it.
LINK_PARAMS = ("link_ratio", "link_gbps", "link_latency_us")


def open_store(url: str, memory_bandwidth: Callable[[], float] | None = None) -> ByteStore:
    """Open a byte store by URL.

    ``memory://[?capacity_bytes=N]`` (embedded, the default), ``redis[s]://...``, ``grpc[s]://...``
    (our store server), ``lmcache://[:TOKEN@]HOST:PORT`` (the LMCache sidecar, which speaks our store
    protocol: ``remote_store.lmcache_sidecar``). Any URL may add
    ``link_ratio=R`` (a link R times slower than ``memory_bandwidth()``, the engine's measured
    memory bandwidth in bytes/s) or ``link_gbps=G``, and ``link_latency_us=U``: the store is then
    wrapped in the link emulator.
    """
    parts = urlsplit(url)
    query = dict(parse_qsl(parts.query))
    link = {k: float(query.pop(k)) for k in LINK_PARAMS if k in query}
    bare = urlunsplit(parts._replace(query=urlencode(query)))
    if parts.scheme == "memory":
        from remote_store.backends.memory import MemoryStore

        store: ByteStore = MemoryStore(int(query.get("capacity_bytes", 0)), url=bare)
    elif parts.scheme in ("redis", "rediss"):
        from remote_store.backends.redis import RedisStore

        store = RedisStore(bare)
    elif parts.scheme in ("grpc", "grpcs"):
        from remote_store.backends.grpc import GrpcStore

        store = GrpcStore(bare)
    elif parts.scheme == "lmcache":
        from remote_store.backends.grpc import GrpcStore

        store = GrpcStore(urlunsplit(parts._replace(scheme="grpc", query=urlencode(query))))
        store.url = bare.split("?")[0].replace(f"{parts.netloc}", parts.netloc.rpartition("@")[2])
    else:
        raise ValueError(f"unknown store URL {url!r}; supported schemes: {', '.join(s + '://' for s in SCHEMES)}")
    if not link:
        return store
    from remote_store.link import LinkEmulator

    latency = link.get("link_latency_us", 0.0) * 1e-6
    if "link_ratio" in link:
        if memory_bandwidth is None:
            raise ValueError("link_ratio needs the engine's memory bandwidth; use link_gbps here")
        ratio = link["link_ratio"]
        return LinkEmulator(store, memory_bandwidth() / ratio, latency, ratio=ratio)
    return LinkEmulator(store, link["link_gbps"] * 1e9, latency)
