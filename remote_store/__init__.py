"""The full-KV tier: a byte store chosen by URL, and the engine's chunked view of it."""

from __future__ import annotations

from collections.abc import Callable
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from remote_store.backends.base import ByteStore, StoreConfigError, StoreError, refused
from remote_store.codec import ChunkError

__all__ = [
    "ByteStore",
    "ChunkError",
    "StoreConfigError",
    "StoreError",
    "connect_store",
    "open_store",
    "redact",
    "refused",
]

SCHEMES = ("memory", "redis", "rediss", "redis-cluster", "rediss-cluster", "grpc", "grpcs", "lmcache")
# Link-emulator parameters, accepted on any URL and stripped before the backend sees it.
LINK_PARAMS = ("link_ratio", "link_gbps", "link_latency_us")


def open_store(url: str, memory_bandwidth: Callable[[], float] | None = None) -> ByteStore:
    """Open a byte store by URL.

    ``memory://[?capacity_bytes=N&pin_ttl_s=S]`` (embedded, the default; capacity a quarter of the
    host's memory unless named, 0 for none; pins are leases of ``pin_ttl_s``), ``redis[s]://...``,
    ``redis[s]-cluster://...`` (a Redis Cluster, through any one node), ``grpc[s]://...``
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
        from remote_store.backends.memory import DEFAULT_PIN_TTL_S, MemoryStore, default_capacity_bytes

        unknown = set(query) - {"capacity_bytes", "pin_ttl_s"}
        if unknown:
            raise ValueError(f"memory:// takes capacity_bytes and pin_ttl_s, not {', '.join(sorted(unknown))}")
        capacity = int(query.get("capacity_bytes", default_capacity_bytes()))  # 0: unbounded
        store: ByteStore = MemoryStore(capacity, url=bare, pin_ttl_s=float(query.get("pin_ttl_s", DEFAULT_PIN_TTL_S)))
    elif parts.scheme in ("redis", "rediss", "redis-cluster", "rediss-cluster"):
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


def redact(url: str) -> str:
    """``url`` without its secret (a token or password in the userinfo part)."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    return urlunsplit(parts._replace(netloc="***@" + parts.netloc.rpartition("@")[2]))


def connect_store(url: str, memory_bandwidth: Callable[[], float] | None = None) -> ByteStore:
    """``open_store``, then one round trip (``ByteStore.probe``): what starts on a store fails at
    once, naming the URL (without its secret) and the cause, when the store cannot be used as
    configured: an unknown scheme or malformed URL, refused or missing credentials, a TLS mismatch,
    an address that does not answer. Later outages are the callers' to fall back from."""
    try:
        store = open_store(url, memory_bandwidth)
    except (ValueError, OSError) as e:
        raise StoreConfigError(f"store {redact(url)}: {e}") from None
    try:
        store.probe()
    except StoreError as e:
        store.close()
        raise StoreConfigError(f"store {redact(url)} cannot be used ({_cause(e)}): {e}") from e
    return store


def _cause(error: StoreError) -> str:
    text = str(error).lower()
    if isinstance(error, StoreConfigError):
        return "it refused this client's credentials"
    if any(t in text for t in ("ssl", "tls", "handshake", "certificate")):
        return "the TLS settings do not match the store's"
    return "it does not answer"
