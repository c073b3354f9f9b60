"""The full-KV tier as a HiCache L3 storage backend, over ``remote_store``.

Selected through SGLang's ``dynamic`` route with the zero-copy page interface::

    --enable-hierarchical-cache --hicache-storage-backend dynamic \\
    --hicache-storage-backend-extra-config '{"backend_name": "vericache",
        "module_path": "vericache_sglang.sglang.storage", "class_name": "VeriCacheHiCacheStorage",
        "interface_v1": 1, "store_url": "redis://127.0.0.1:6379/0"}'

Each HiCache page (all layers, K and V, as the host pool lays it out) is one record in the store:
our chunk header (layout digest of model, TP rank and page geometry; a digest of the page's key,
which SGLang chains over the token prefix; a CRC) and the page bytes. Every read is checked; a page
that fails a check is reported missing, never copied into the host pool. Like every HiCache
backend, the data path never raises: a store that goes away makes pages miss, and SGLang then
recomputes them.
"""

from __future__ import annotations

import hashlib
import logging
from typing import TYPE_CHECKING, Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

from remote_store import connect_store
from remote_store.codec import KIND_PACKED, ChunkError, ChunkHeader, check, decode, encode
from vericache_sglang.engine.hardware import memory_bandwidth

if TYPE_CHECKING:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, HiCacheStorageExtraInfo
    from sglang.srt.mem_cache.pool_host import HostKVCache

logger = logging.getLogger(__name__)

_TORCH_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def _digest16(text: str) -> bytes:
    return hashlib.blake2b(text.encode(), digest_size=16).digest()


class VeriCacheHiCacheStorage(HiCacheStorage):
    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict | None = None):
        extra = dict(getattr(storage_config, "extra_config", None) or {})
        url = extra.get("store_url")
        if not url:
            raise ValueError("the vericache HiCache backend needs extra_config['store_url'] (a remote_store URL)")
        self.config = storage_config
        self.namespace = str(extra.get("namespace", "hicache"))
        self.ttl_s = float(extra["ttl_s"]) if extra.get("ttl_s") else None
        # a store that cannot be used as configured fails the launch; an emulated link
        # (?link_ratio=R) is set against the device's memory bandwidth, as for the full-KV tier
        device = "cuda" if torch.cuda.is_available() else "cpu"
        self.store = connect_store(url, memory_bandwidth=lambda: memory_bandwidth(device))
        self.mem_pool_host: HostKVCache | None = None
        self._layout_digest: str | None = None
        self.stats_pages = {"set": 0, "get_hit": 0, "get_miss": 0, "get_bad": 0, "store_errors": 0}

    # -- geometry ---------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: HostKVCache) -> None:
        super().register_mem_pool_host(mem_pool_host)
        if mem_pool_host.dtype not in _TORCH_NAMES and torch.empty((), dtype=mem_pool_host.dtype).element_size() != 1:
            raise ValueError(f"vericache HiCache backend: unsupported host pool dtype {mem_pool_host.dtype}")
        cfg = self.config
        described = "|".join(
            str(x)
            for x in (
                getattr(cfg, "model_name", None),
                getattr(cfg, "tp_rank", 0),
                getattr(cfg, "tp_size", 1),
                getattr(cfg, "is_mla_model", False),
                mem_pool_host.layout,
                mem_pool_host.page_size,
                mem_pool_host.layer_num,
                getattr(mem_pool_host, "head_num", 0),
                getattr(mem_pool_host, "head_dim", 0),
                mem_pool_host.dtype,
            )
        )
        self._layout_digest = hashlib.blake2b(described.encode(), digest_size=8).hexdigest()

    def _require_pool(self) -> HostKVCache:
        if self.mem_pool_host is None or self._layout_digest is None:
            raise RuntimeError("vericache HiCache backend used before register_mem_pool_host")
        return self.mem_pool_host

    def _store_key(self, key: str) -> str:
        return f"{self.namespace}:page:{self._layout_digest}:{key}"

    def _header(self, key: str, payload_len: int) -> ChunkHeader:
        pool = self.mem_pool_host
        dtype = _TORCH_NAMES.get(pool.dtype, "uint8")
        return ChunkHeader(
            KIND_PACKED,
            dtype,
            pool.layer_num,
            getattr(pool, "head_num", 0),
            pool.page_size,
            getattr(pool, "head_dim", 0),
            0,
            self._layout_digest,
            _digest16(key),
            0,
            payload_len,
        )

    def _encode_page(self, key: str, page: torch.Tensor) -> bytes:
        raw = page.contiguous().view(torch.uint8).cpu().numpy().tobytes()  # .cpu() is a no-op on host pages
        return encode(self._header(key, len(raw)), raw)

    def _decode_page(self, key: str, record: bytes) -> torch.Tensor:
        header, payload = decode(record)
        pool = self.mem_pool_host
        check(
            header,
            layout_digest=self._layout_digest,
            prefix_digest=_digest16(key),
            layer=pool.layer_num,
            tokens=pool.page_size,
            start=0,
        )
        expected = pool.get_dummy_flat_data_page()
        if len(payload) != expected.numel() * expected.element_size():
            raise ChunkError(
                f"page of {len(payload)} bytes, the host pool's pages hold {expected.numel() * expected.element_size()}"
            )
        return torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(expected.dtype)

    # -- zero-copy page interface (interface_v1) ------------------------------------------------

    def _page_indices(self, keys: list[str], host_indices: torch.Tensor) -> list[int]:
        pool = self._require_pool()
        if len(host_indices) != len(keys) * pool.page_size:
            raise ValueError(
                f"{len(keys)} pages need {len(keys) * pool.page_size} host indices, got {len(host_indices)}"
            )
        return [int(host_indices[i * pool.page_size]) for i in range(len(keys))]

    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        pool = self._require_pool()
        starts = self._page_indices(keys, host_indices)
        items = [
            (self._store_key(k), self._encode_page(k, pool.get_data_page(s, flat=True)))
            for k, s in zip(keys, starts, strict=True)
        ]
        try:
            self.store.put_many(items, ttl_s=self.ttl_s)
        except Exception as e:
            self.stats_pages["store_errors"] += 1
            logger.warning("vericache HiCache backend: storing %d pages failed: %s", len(keys), e)
            return [False] * len(keys)
        self.stats_pages["set"] += len(keys)
        return [True] * len(keys)

    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        pool = self._require_pool()
        starts = self._page_indices(keys, host_indices)
        try:
            records = self.store.get_many([self._store_key(k) for k in keys])
        except Exception as e:
            self.stats_pages["store_errors"] += 1
            logger.warning("vericache HiCache backend: reading %d pages failed: %s", len(keys), e)
            return [False] * len(keys)
        ok = []
        for key, start, record in zip(keys, starts, records, strict=True):
            if record is None:
                self.stats_pages["get_miss"] += 1
                ok.append(False)
                continue
            try:
                page = self._decode_page(key, record)
            except ChunkError as e:
                self.stats_pages["get_bad"] += 1
                logger.warning("vericache HiCache backend: page %s rejected: %s", key, e)
                ok.append(False)
                continue
            pool.set_from_flat_data_page(start, page)
            self.stats_pages["get_hit"] += 1
            ok.append(True)
        return ok

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        self._require_pool()
        try:
            present = self.store.exists_many([self._store_key(k) for k in keys])
        except Exception as e:
            self.stats_pages["store_errors"] += 1
            logger.warning("vericache HiCache backend: exists on %d pages failed: %s", len(keys), e)
            return 0
        n = 0
        while n < len(present) and present[n]:
            n += 1
        return n

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # -- the generic (copying) interface, for controllers that do not use v1 ----------------------

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        self._require_pool()
        try:
            (record,) = self.store.get_many([self._store_key(key)])
        except Exception as e:
            logger.warning("vericache HiCache backend: get %s failed: %s", key, e)
            return None
        if record is None:
            return None
        try:
            page = self._decode_page(key, record)
        except ChunkError as e:
            logger.warning("vericache HiCache backend: page %s rejected: %s", key, e)
            return None
        if target_location is not None:
            target_location.view(-1).copy_(page.view(target_location.dtype).view(-1))
            return target_location
        return page

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None) -> list:
        targets = target_locations if target_locations is not None else [None] * len(keys)
        return [self.get(k, t) for k, t in zip(keys, targets, strict=True)]

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(
        self, keys: list[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None
    ) -> bool:
        self._require_pool()
        if values is None or len(values) != len(keys):
            raise ValueError("batch_set needs one page tensor per key")
        try:
            self.store.put_many(
                [(self._store_key(k), self._encode_page(k, v.reshape(-1))) for k, v in zip(keys, values, strict=True)],
                ttl_s=self.ttl_s,
            )
        except Exception as e:
            logger.warning("vericache HiCache backend: batch_set of %d pages failed: %s", len(keys), e)
            return False
        return True

    def clear(self) -> None:
        logger.info(
            "vericache HiCache backend: clear() leaves the shared store as it is (pages expire or are "
            "evicted by the store)"
        )

    def get_stats(self) -> None:
        """SGLang's storage metrics hook: it expects a ``StorageMetrics`` or None (then it counts
        prefetches itself); our page counts are ``page_stats()``."""
        return None

    def page_stats(self) -> dict[str, Any]:
        """Pages written, hit, missed and refused by a check, store errors, and the store's stats."""
        stats: dict[str, Any] = dict(self.stats_pages)
        try:
            stats["store"] = self.store.stats()
        except Exception as e:
            stats["store"] = {"error": str(e)}
        return stats

    def close(self) -> None:
        self.store.close()


__all__ = ["VeriCacheHiCacheStorage"]
