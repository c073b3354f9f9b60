"""``redis://`` and ``rediss://``: records in a real Redis server, pipelined; ``redis-cluster://``
and ``rediss-cluster://``: the same records sharded over a Redis Cluster by its own hash slots.

URL: ``redis[s]://[:PASSWORD@]HOST:PORT[/DB][?default_ttl_s=S&timeout_s=T&ssl_ca_certs=F...]``
(auth and TLS are redis-py's own URL options); ``redis[s]-cluster://[:PASSWORD@]HOST:PORT[?...]``
names any one node of a cluster (redis-py's cluster client finds the others and the slot map).

In a cluster, each batch is split by the node that owns each key and pipelined to each node; a
record's pin counter is ``pin:{KEY}``, so it hashes to the record's slot and the pin scripts run
on one node. A batch that meets a slot moving (MOVED, ASK) fails as a store error, as an
unreachable node does; the client reloads the slot map for the next batch.

Eviction and pins: run Redis with ``maxmemory-policy volatile-lru``, so only records with a TTL can
be evicted. Every record is written with a TTL (its own, or ``default_ttl_s`` for shared prefix
chunks), except while pinned: a pin removes the TTL (PERSIST) and counts holders in
``pin:KEY``; the last unpin restores the TTL. A client that dies holding pins leaves those records
persistent until they are deleted.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import redis
from redis.exceptions import RedisClusterException

from remote_store.backends.base import ByteStore, RangeRequest, StoreConfigError, StoreError

_OWN_PARAMS = ("default_ttl_s", "timeout_s")
_BATCH_BYTES = 32 << 20

# KEYS[1] record, KEYS[2] its pin counter; ARGV[1] value, ARGV[2] ttl in ms (0: none)
_PUT = """
local ttl = tonumber(ARGV[2])
if redis.call('EXISTS', KEYS[2]) == 1 then
  if ttl > 0 then redis.call('HSET', KEYS[2], 'ttl', ttl) end  -- restored on the last unpin
  return redis.call('SET', KEYS[1], ARGV[1])
end
if ttl > 0 then return redis.call('SET', KEYS[1], ARGV[1], 'PX', ttl) end
return redis.call('SET', KEYS[1], ARGV[1])
"""
# Pin and unpin only touch small bookkeeping keys and TTLs, so they may run when Redis is at its
# maxmemory (allow-oom): a full store of pinned records must still be able to release them.
# KEYS[1] record, KEYS[2] pin counter; ARGV[1] ttl in ms to restore on the last unpin
_PIN = """#!lua flags=allow-oom
redis.call('HINCRBY', KEYS[2], 'n', 1)
if redis.call('HEXISTS', KEYS[2], 'ttl') == 0 then
  local left = redis.call('PTTL', KEYS[1])
  redis.call('HSET', KEYS[2], 'ttl', left > 0 and left or tonumber(ARGV[1]))
end
redis.call('PERSIST', KEYS[1])
return 1
"""
_UNPIN = """#!lua flags=allow-oom
if redis.call('EXISTS', KEYS[2]) == 0 then return 0 end
local n = redis.call('HINCRBY', KEYS[2], 'n', -1)
if n > 0 then return n end
local ttl = tonumber(redis.call('HGET', KEYS[2], 'ttl'))
redis.call('DEL', KEYS[2])
if ttl and ttl > 0 and redis.call('EXISTS', KEYS[1]) == 1 then redis.call('PEXPIRE', KEYS[1], ttl) end
return 0
"""


def _refused(e: redis.RedisError) -> bool:
    """Whether Redis refused this client's credentials (wrong, missing, or for a user it lacks)."""
    if isinstance(e, redis.AuthenticationError | redis.AuthenticationWrongNumberOfArgsError):
        return True
    text = str(e)
    return isinstance(e, redis.ResponseError) and any(t in text for t in ("NOAUTH", "WRONGPASS", "NOPERM"))


def _pin_key(key: str) -> str:
    return f"pin:{{{key}}}"  # a hash tag: the counter lives in its record's cluster slot


class RedisStore(ByteStore):
    def __init__(self, url: str):
        parts = urlsplit(url)
        self.cluster = parts.scheme.endswith("-cluster")
        parts = parts._replace(scheme=parts.scheme.removesuffix("-cluster"))
        query = dict(parse_qsl(parts.query))
        own = {k: query.pop(k) for k in _OWN_PARAMS if k in query}
        self.url = urlunsplit(parts._replace(query=urlencode(query), netloc=parts.netloc.rpartition("@")[2]))
        if self.cluster:
            self.url = self.url.replace("://", "-cluster://", 1)
            if parts.path.strip("/") not in ("", "0"):
                raise StoreConfigError(f"a Redis Cluster has one database (0), not {parts.path.strip('/')}")
        self.default_ttl_ms = int(float(own.get("default_ttl_s", 86400)) * 1000)
        timeout = float(own.get("timeout_s", 10))
        options = {"socket_timeout": timeout, "socket_connect_timeout": timeout}
        target = urlunsplit(parts._replace(query=urlencode(query), path=""))
        if self.cluster:
            try:
                self.client = redis.RedisCluster.from_url(target, **options)
            except (redis.RedisError, RedisClusterException) as e:  # the slot map is read at once
                kind = StoreConfigError if isinstance(e, redis.RedisError) and _refused(e) else StoreError
                raise kind(f"redis cluster at {self.url}: {e}") from e
        else:
            target = urlunsplit(parts._replace(query=urlencode(query)))
            self.client = redis.Redis.from_url(target, health_check_interval=30, **options)
        self._put = self.client.register_script(_PUT)
        self._pin = self.client.register_script(_PIN)
        self._unpin = self.client.register_script(_UNPIN)

    def _call(self, what: str, fn):
        try:
            return fn()
        except (redis.RedisError, RedisClusterException) as e:
            if self.cluster:  # a slot moved or a node went away: the next batch reads the map again
                with contextlib.suppress(redis.RedisError, RedisClusterException):
                    self.client.nodes_manager.initialize()
            kind = StoreConfigError if isinstance(e, redis.RedisError) and _refused(e) else StoreError
            raise kind(f"redis {what} failed at {self.url}: {e}") from e

    def _by_node(self, keys: Sequence[str]) -> list[tuple[redis.Redis, list[int]]]:
        """The positions of ``keys`` grouped by the Redis server that holds them (one without a cluster)."""
        if not self.cluster:
            return [(self.client, list(range(len(keys))))]
        groups: dict[str, tuple[redis.Redis, list[int]]] = {}
        for i, key in enumerate(keys):
            node = self.client.get_node_from_key(key)
            groups.setdefault(node.name, (node.redis_connection, []))[1].append(i)
        return list(groups.values())

    def _ttl_ms(self, ttl_s: float | None) -> int:
        return self.default_ttl_ms if ttl_s is None else max(1, int(ttl_s * 1000))

    def _pipelined(self, keys: Sequence[str], queue: Callable[[redis.client.Pipeline, list[int]], None]) -> list:
        """``queue(pipe, positions)`` the commands for those keys on each node's pipeline; the
        replies of every node, in the order of ``keys``' positions as each queued them."""
        replies: list = []
        for client, positions in self._by_node(keys):
            pipe = client.pipeline(transaction=False)
            queue(pipe, positions)
            replies.append((positions, pipe.execute()))
        return replies

    def _each(self, keys: Sequence[str], command: Callable[[redis.client.Pipeline, str], object]) -> list:
        """One pipelined ``command(pipe, key)`` per key; the replies in the order of ``keys``."""
        out: list = [None] * len(keys)
        queue = lambda pipe, positions: [command(pipe, keys[i]) for i in positions]
        for positions, replies in self._pipelined(keys, queue):
            for i, reply in zip(positions, replies, strict=True):
                out[i] = reply
        return out

    def put_many(self, items: Sequence[tuple[str, bytes]], ttl_s: float | None = None) -> None:
        ttl = self._ttl_ms(ttl_s)

        def run() -> None:
            for client, positions in self._by_node([key for key, _ in items]):
                pipe, size = client.pipeline(transaction=False), 0
                for i in positions:
                    key, value = items[i]
                    self._put(keys=[key, _pin_key(key)], args=[value, ttl], client=pipe)
                    size += len(value)
                    if size >= _BATCH_BYTES:
                        pipe.execute()
                        pipe, size = client.pipeline(transaction=False), 0
                pipe.execute()

        self._call("put", run)

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        if not keys:
            return []
        if not self.cluster:
            return self._call("get", lambda: self.client.mget(list(keys)))

        return self._call("get", lambda: self._each(keys, lambda pipe, key: pipe.get(key)))

    def get_ranges(self, requests: Sequence[RangeRequest]) -> list[list[bytes] | None]:
        def queue(pipe, positions: list[int]) -> None:
            for i in positions:
                key, ranges = requests[i]
                pipe.exists(key)
                for offset, length in ranges:
                    pipe.getrange(key, offset, offset + length - 1)

        def run() -> list[list[bytes] | None]:
            out: list[list[bytes] | None] = [None] * len(requests)
            for positions, values in self._pipelined([key for key, _ in requests], queue):
                replies = iter(values)
                for i in positions:
                    found = next(replies)
                    parts = [next(replies) for _ in requests[i][1]]
                    out[i] = parts if found else None
            return out

        return self._call("get", run) if requests else []

    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        run = lambda: [bool(n) for n in self._each(keys, lambda pipe, key: pipe.exists(key))]
        return self._call("exists", run) if keys else []

    def delete_many(self, keys: Sequence[str]) -> int:
        def queue(pipe, positions: list[int]) -> None:
            for i in positions:  # one key a command: a cluster pipeline takes no multi-key DEL
                pipe.delete(keys[i])
                pipe.delete(_pin_key(keys[i]))

        def run() -> int:
            return sum(sum(replies[::2]) for _, replies in self._pipelined(keys, queue))

        return self._call("delete", run) if keys else 0

    def _scripted(self, what: str, script, keys: Sequence[str]) -> None:
        def queue(pipe, positions: list[int]) -> None:
            for i in positions:
                script(keys=[keys[i], _pin_key(keys[i])], args=[self.default_ttl_ms], client=pipe)

        if keys:
            self._call(what, lambda: self._pipelined(keys, queue))

    def pin(self, keys: Sequence[str]) -> None:
        self._scripted("pin", self._pin, keys)

    def unpin(self, keys: Sequence[str]) -> None:
        self._scripted("unpin", self._unpin, keys)

    def stats(self) -> dict[str, object]:
        def run() -> dict[str, object]:
            nodes = [n.redis_connection for n in self.client.get_primaries()] if self.cluster else [self.client]
            mem, st = [c.info("memory") for c in nodes], [c.info("stats") for c in nodes]
            return {
                "keys": sum(c.dbsize() for c in nodes),
                "bytes": sum(m.get("used_memory", 0) for m in mem),
                "capacity_bytes": sum(m.get("maxmemory", 0) for m in mem),
                "hits": sum(x.get("keyspace_hits", 0) for x in st),
                "misses": sum(x.get("keyspace_misses", 0) for x in st),
                "evictions": sum(x.get("evicted_keys", 0) for x in st),
                "eviction_policy": mem[0].get("maxmemory_policy", ""),
                **({"nodes": len(nodes)} if self.cluster else {}),
            }

        return self._call("stats", run)

    def close(self) -> None:
        self.client.close()
