"""``lmcache://``: the full-KV tier through the real LMCache 0.5.6, as a sidecar in its own environment.

LMCache 0.5.6 is built on torch 2.13.0 and cannot share the main environment (torch 2.14.1), so it
runs here, in ``.venv-lmcache`` (``scripts/setup_lmcache.sh``), and serves our store protocol
(``proto/store.proto``) to the engine, which talks to it with the gRPC client:

    python -m remote_store.lmcache_sidecar --listen 127.0.0.1:PORT --remote-url redis://127.0.0.1:6379

Each record goes through LMCache's engine: an ``LMCacheEngine`` (with a connector of ours, which
the record path never calls) whose storage manager stages it in LMCache's local CPU backend and
writes it through LMCache's remote connector for ``--remote-url`` (``redis://``, ``lm://``,
``fs://``, ...). A record is stored as one LMCache chunk of a byte-model layout (uint8,
``[2, 1, n, 1]``, length-framed), keyed by a 63-bit digest of our key. Our records keep their own
header and checksums, which the engine checks on every read. Not supported by LMCache 0.5.6's
remote tier: TTLs, pins and deletion (its Redis connector implements no removal, and its entries
never expire: only the Redis server's own eviction drops them); puts are made durable by waiting
until the remote backend reports the record.
"""

from __future__ import annotations

import hashlib
import os
import sys
import threading
import time
from collections.abc import Sequence

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")  # LMCache reports usage to its authors by default

from remote_store.backends.base import ByteStore, StoreError
from remote_store.server import serve, server_args

MODEL = "vericache-records"
CHUNK_TOKENS = 1 << 20  # records of up to 2 MiB
_FRAME = 8  # little-endian length before the record


class LMCacheRecordStore(ByteStore):
    def __init__(self, remote_url: str, local_cpu_gb: float = 0.5, put_timeout_s: float = 30.0):
        import torch
        from lmcache.v1.cache_engine import LMCacheEngineBuilder
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.gpu_connector import GPUConnectorInterface
        from lmcache.v1.memory_management import MemoryFormat
        from lmcache.v1.metadata import LMCacheMetadata

        class RecordConnector(GPUConnectorInterface):
            """The engine requires a connector; records never come from or go to a device."""

            def to_gpu(self, memory_obj, start, end, **kw):
                raise NotImplementedError("records are stored through the storage manager")

            from_gpu = batched_to_gpu = batched_from_gpu = to_gpu

            def get_shape(self, num_tokens):
                return torch.Size([2, 1, num_tokens, 1])

        self._torch, self._fmt = torch, MemoryFormat.KV_2LTD
        self.url = f"lmcache://{remote_url}"
        self.put_timeout_s = put_timeout_s
        # One LMCache chunk per record: ``chunk_size`` bounds a record at 2 * chunk_size bytes.
        config = LMCacheEngineConfig.from_defaults(
            chunk_size=CHUNK_TOKENS,
            local_cpu=False,
            max_local_cpu_size=local_cpu_gb,
            remote_url=remote_url,
            remote_serde="naive",
            save_unfull_chunk=True,
        )
        meta = LMCacheMetadata(
            model_name=MODEL,
            world_size=1,
            local_world_size=1,
            worker_id=0,
            local_worker_id=0,
            kv_dtype=torch.uint8,
            kv_shape=(1, 2, CHUNK_TOKENS, 1, 1),
        )
        self._instance = f"vericache-{os.getpid()}"
        self.engine = LMCacheEngineBuilder.get_or_create(
            self._instance, config, meta, RecordConnector(), lambda t, src: t, lambda o, src: o
        )
        self.engine.post_init()
        self.sm = self.engine.storage_manager
        if "RemoteBackend" not in self.sm.storage_backends:
            raise StoreError(f"LMCache did not create a remote backend for {remote_url}")
        self._lock = threading.Lock()
        self._counters = {"puts": 0, "hits": 0, "misses": 0}

    def _key(self, key: str):
        from lmcache.utils import CacheEngineKey

        digest = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big") >> 1
        return CacheEngineKey(MODEL, 1, 0, digest, self._torch.uint8)

    def _in_remote(self, key) -> bool:
        return self.sm.contains(key, ["RemoteBackend"]) is not None

    def put_many(self, items: Sequence[tuple[str, bytes]], ttl_s: float | None = None) -> None:
        torch = self._torch
        keys, objs = [], []
        for key, value in items:
            framed = len(value).to_bytes(_FRAME, "little") + bytes(value)
            framed += b"\0" * (len(framed) % 2)
            obj = self.sm.allocate(torch.Size([2, 1, len(framed) // 2, 1]), torch.uint8, fmt=self._fmt)
            if obj is None:
                raise StoreError("LMCache's staging buffer is full")
            obj.tensor.view(-1).copy_(torch.frombuffer(bytearray(framed), dtype=torch.uint8))
            keys.append(self._key(key))
            objs.append(obj)
        with self._lock:
            # LMCache keeps the record it already holds under a key. Our keys name a token prefix, so a
            # second write under one carries the same K/V (at most recomputed), and keeping the first is right.
            self.sm.batched_put(keys, objs)  # asynchronous in LMCache: wait until the remote has them all
            deadline = time.monotonic() + self.put_timeout_s
            while not all(self._in_remote(k) for k in keys):
                if time.monotonic() > deadline:
                    raise StoreError(f"LMCache did not confirm {len(keys)} records within {self.put_timeout_s} s")
                time.sleep(0.002)
            self._counters["puts"] += len(keys)

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        out: list[bytes | None] = []
        for key in keys:
            obj = self.sm.get(self._key(key), "RemoteBackend")
            if obj is None:
                self._counters["misses"] += 1
                out.append(None)
                continue
            raw = obj.tensor.contiguous().view(-1).numpy().tobytes()
            obj.ref_count_down()
            n = int.from_bytes(raw[:_FRAME], "little")
            out.append(raw[_FRAME : _FRAME + n] if n <= len(raw) - _FRAME else raw)  # a bad frame fails the checks
            self._counters["hits"] += 1
        return out

    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        return [self._in_remote(self._key(k)) for k in keys]

    def delete_many(self, keys: Sequence[str]) -> int:
        # LMCache 0.5.6's remote connectors (Redis among them) do not implement removal: records stay
        # until the remote's own eviction. Nothing is deleted; the count says so.
        return 0

    def stats(self) -> dict[str, object]:
        return {
            **self._counters,
            "capacity_bytes": 0,
            "pins_supported": 0,
            "ttl_supported": 0,
            "delete_supported": 0,
            "eviction_policy": "the LMCache remote's own (no pins, no TTL)",
        }

    def close(self) -> None:
        from lmcache.v1.cache_engine import LMCacheEngineBuilder

        # LMCache's engine teardown can hang (seen with 0.5.6 on CPU): give it a few seconds.
        closer = threading.Thread(target=LMCacheEngineBuilder.destroy, args=(self._instance,), daemon=True)
        closer.start()
        closer.join(5.0)


def main(argv: list[str] | None = None) -> int:
    p = server_args("python -m remote_store.lmcache_sidecar", __doc__)
    p.add_argument("--remote-url", required=True, help="LMCache's remote: redis://HOST:PORT, lm://HOST:PORT, ...")
    p.add_argument("--local-cpu-gb", type=float, default=0.5, help="LMCache's CPU staging buffer")
    args = p.parse_args(argv)
    return serve(args, LMCacheRecordStore(args.remote_url, args.local_cpu_gb), f"LMCache sidecar ({args.remote_url})")


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # LMCache leaves non-daemon threads behind; the drain above already ran
