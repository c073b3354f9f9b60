"""``redis://`` and ``rediss://``: records in a real Redis server, pipelined.

URL: ``redis[s]://[:PASSWORD@]HOST:PORT[/DB][?default_ttl_s=S&timeout_s=T&ssl_ca_certs=F...]``
(auth and TLS are redis-py's own URL options).

Eviction and pins: run Redis with ``maxmemory-policy volatile-lru``, so only records with a TTL can
be evicted. Every record is written with a TTL (its own, or ``default_ttl_s`` for shared prefix
chunks), except while pinned: a pin removes the TTL (PERSIST) and counts holders in
``pin:KEY``; the last unpin restores the TTL. A client that dies holding pins leaves those records
persistent until they are deleted.
"""

from __future__ import annotations

from collections.abc import Sequence
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import redis

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
    return f"pin:{key}"


class RedisStore(ByteStore):
    def __init__(self, url: str):
        parts = urlsplit(url)
        query = dict(parse_qsl(parts.query))
        own = {k: query.pop(k) for k in _OWN_PARAMS if k in query}
        self.url = urlunsplit(parts._replace(query=urlencode(query), netloc=parts.netloc.rpartition("@")[2]))
        self.default_ttl_ms = int(float(own.get("default_ttl_s", 86400)) * 1000)
        timeout = float(own.get("timeout_s", 10))
        self.client = redis.Redis.from_url(
            urlunsplit(parts._replace(query=urlencode(query))),
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            health_check_interval=30,
        )
        self._put = self.client.register_script(_PUT)
        self._pin = self.client.register_script(_PIN)
        self._unpin = self.client.register_script(_UNPIN)

    def _call(self, what: str, fn):
        try:
            return fn()
        except redis.RedisError as e:
            kind = StoreConfigError if _refused(e) else StoreError
            raise kind(f"redis {what} failed at {self.url}: {e}") from e

    def _ttl_ms(self, ttl_s: float | None) -> int:
        return self.default_ttl_ms if ttl_s is None else max(1, int(ttl_s * 1000))

    def put_many(self, items: Sequence[tuple[str, bytes]], ttl_s: float | None = None) -> None:
        ttl = self._ttl_ms(ttl_s)

        def run() -> None:
            pipe, size = self.client.pipeline(transaction=False), 0
            for key, value in items:
                self._put(keys=[key, _pin_key(key)], args=[value, ttl], client=pipe)
                size += len(value)
                if size >= _BATCH_BYTES:
                    pipe.execute()
                    pipe, size = self.client.pipeline(transaction=False), 0
            pipe.execute()

        self._call("put", run)

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        if not keys:
            return []
        return self._call("get", lambda: self.client.mget(list(keys)))

    def get_ranges(self, requests: Sequence[RangeRequest]) -> list[list[bytes] | None]:
        def run() -> list[list[bytes] | None]:
            pipe = self.client.pipeline(transaction=False)
            for key, ranges in requests:
                pipe.exists(key)
                for offset, length in ranges:
                    pipe.getrange(key, offset, offset + length - 1)
            replies = iter(pipe.execute())
            out: list[list[bytes] | None] = []
            for _, ranges in requests:
                found = next(replies)
                parts = [next(replies) for _ in ranges]
                out.append(parts if found else None)
            return out

        return self._call("get", run) if requests else []

    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        def run() -> list[bool]:
            pipe = self.client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(key)
            return [bool(n) for n in pipe.execute()]

        return self._call("exists", run) if keys else []

    def delete_many(self, keys: Sequence[str]) -> int:
        def run() -> int:
            pipe = self.client.pipeline(transaction=False)
            pipe.delete(*keys)
            pipe.delete(*map(_pin_key, keys))
            return pipe.execute()[0]

        return self._call("delete", run) if keys else 0

    def _scripted(self, what: str, script, keys: Sequence[str]) -> None:
        def run() -> None:
            pipe = self.client.pipeline(transaction=False)
            for key in keys:
                script(keys=[key, _pin_key(key)], args=[self.default_ttl_ms], client=pipe)
            pipe.execute()

        if keys:
            self._call(what, run)

    def pin(self, keys: Sequence[str]) -> None:
        self._scripted("pin", self._pin, keys)

    def unpin(self, keys: Sequence[str]) -> None:
        self._scripted("unpin", self._unpin, keys)

    def stats(self) -> dict[str, object]:
        def run() -> dict[str, object]:
            mem, st = self.client.info("memory"), self.client.info("stats")
            return {
                "keys": self.client.dbsize(),
                "bytes": mem.get("used_memory", 0),
                "capacity_bytes": mem.get("maxmemory", 0),
                "hits": st.get("keyspace_hits", 0),
                "misses": st.get("keyspace_misses", 0),
                "evictions": st.get("evicted_keys", 0),
                "eviction_policy": mem.get("maxmemory_policy", ""),
            }

        return self._call("stats", run)

    def close(self) -> None:
        self.client.close()
