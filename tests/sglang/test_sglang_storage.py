"""The vericache HiCache storage backend through SGLang's own StorageBackendFactory ``dynamic`` route,
against a real Redis and our real gRPC store server, with SGLang's own host KV pool (CPU)."""

from __future__ import annotations

import time

import pytest
import torch

pytest.importorskip("sglang.srt.mem_cache.storage.backend_factory", reason="sglang is not installed")

from hicache_pools import device_and_host_pools
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

from remote_store import open_store
from vericache_sglang.sglang.storage import VeriCacheHiCacheStorage

pytestmark = pytest.mark.service
PAGE = 4
LAYERS, HEADS, DIM = 3, 3, 64


def _host_pool(layout: str = "page_first", dtype=torch.float32) -> MHATokenToKVPoolHost:
    return device_and_host_pools(layout, PAGE, LAYERS, HEADS, DIM, size=256, dtype=dtype)[1]


def _backend(url: str, host, namespace: str) -> VeriCacheHiCacheStorage:
    extra = {
        "backend_name": "vericache",
        "module_path": "vericache_sglang.sglang.storage",
        "class_name": "VeriCacheHiCacheStorage",
        "interface_v1": 1,
        "store_url": url,
        "namespace": namespace,
    }
    cfg = HiCacheStorageConfig(
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=False,
        enable_storage_metrics=False,
        is_page_first_layout=True,
        model_name="SmolLM2-135M-Instruct",
        extra_config=extra,
    )
    backend = StorageBackendFactory.create_backend("dynamic", cfg, host)
    assert isinstance(backend, VeriCacheHiCacheStorage)
    backend.register_mem_pool_host(host)
    return backend


def _fill(host, n_pages: int, seed: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    idx = host.alloc(n_pages * PAGE)
    g = torch.Generator().manual_seed(seed)
    pages = []
    for i in range(n_pages):
        page = torch.randn(host.get_dummy_flat_data_page().shape, generator=g).to(host.dtype)
        host.set_from_flat_data_page(int(idx[i * PAGE]), page)
        pages.append(page)
    return idx, pages


@pytest.fixture(params=["redis", "grpc"])
def url(request):
    return request.getfixturevalue({"redis": "redis_url", "grpc": "store_url"}[request.param])


def test_pages_round_trip_bit_exact_and_missing_keys_miss(url):
    ns = f"t{time.monotonic_ns()}"
    host = _host_pool()
    backend = _backend(url, host, ns)
    idx, pages = _fill(host, 5, seed=1)
    keys = [f"page-{i}" for i in range(5)]
    assert backend.batch_set_v1(keys, idx) == [True] * 5
    assert backend.batch_exists(keys) == 5
    assert backend.batch_exists([*keys[:2], "absent", *keys[3:]]) == 2

    into = host.alloc(6 * PAGE)
    got = backend.batch_get_v1([*keys[:3], "absent", *keys[3:5]], into)
    assert got == [True, True, True, False, True, True]
    for slot, page in zip([0, 1, 2, 4, 5], pages, strict=True):
        assert torch.equal(host.get_data_page(int(into[slot * PAGE])), page)
    assert backend.page_stats()["get_miss"] == 1

    # the generic interface reads the same records
    flat = backend.get(keys[1])
    assert torch.equal(flat, pages[1])
    assert backend.get("absent") is None


def test_bf16_pages_and_another_geometry_do_not_mix(url):
    ns = f"t{time.monotonic_ns()}"
    host = _host_pool(dtype=torch.bfloat16)
    backend = _backend(url, host, ns)
    idx, pages = _fill(host, 2, seed=2)
    assert backend.batch_set_v1(["a", "b"], idx) == [True, True]
    into = host.alloc(2 * PAGE)
    assert backend.batch_get_v1(["a", "b"], into) == [True, True]
    assert torch.equal(host.get_data_page(int(into[PAGE])), pages[1])
    # a float32 pool (another layout digest) never sees the bf16 pages
    other = _backend(url, _host_pool(dtype=torch.float32), ns)
    assert other.batch_exists(["a", "b"]) == 0


def test_damaged_page_is_refused_never_copied(url):
    ns = f"t{time.monotonic_ns()}"
    host = _host_pool()
    backend = _backend(url, host, ns)
    idx, _ = _fill(host, 2, seed=3)
    assert backend.batch_set_v1(["x", "y"], idx) == [True, True]
    raw = open_store(url)
    key = backend._store_key("y")
    (record,) = raw.get_many([key])
    damaged = bytearray(record)
    damaged[len(damaged) // 2] ^= 0x40
    raw.put_many([(key, bytes(damaged))])
    # a record stored under another key's name fails the key digest
    raw.put_many([(backend._store_key("z"), record)])
    into = host.alloc(3 * PAGE)
    before = host.get_data_page(int(into[PAGE])).clone()
    assert backend.batch_get_v1(["x", "y", "z"], into) == [True, False, False]
    assert torch.equal(host.get_data_page(int(into[PAGE])), before)  # untouched
    assert backend.page_stats()["get_bad"] == 2
    raw.close()


def test_store_that_goes_away_makes_pages_miss_without_raising(tmp_path):
    from services import StoreServer

    server = StoreServer(tmp_path)
    host = _host_pool()
    backend = _backend(server.url, host, "gone")
    idx, _ = _fill(host, 3, seed=4)
    assert backend.batch_set_v1(["p0", "p1", "p2"], idx) == [True] * 3
    server.kill()
    t0 = time.monotonic()
    into = host.alloc(3 * PAGE)
    assert backend.batch_get_v1(["p0", "p1", "p2"], into) == [False] * 3
    assert backend.batch_exists(["p0"]) == 0
    assert backend.batch_set_v1(["p3"], idx[:PAGE]) == [False]
    assert time.monotonic() - t0 < 60
    assert backend.page_stats()["store_errors"] >= 3


def test_missing_store_url_is_a_clear_error():
    cfg = HiCacheStorageConfig(
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=False,
        enable_storage_metrics=False,
        is_page_first_layout=True,
        model_name="m",
        extra_config={
            "backend_name": "vericache",
            "interface_v1": 1,
            "module_path": "vericache_sglang.sglang.storage",
            "class_name": "VeriCacheHiCacheStorage",
        },
    )
    with pytest.raises(ValueError, match="store_url"):
        StorageBackendFactory.create_backend("dynamic", cfg, None)


def test_a_store_it_cannot_use_fails_the_backend_at_start(store_url):
    """A wrong token (or no answer) is a configuration error when SGLang builds the backend, naming
    the store without its secret; never a silent miss on every page later."""
    from services import free_port

    from remote_store import StoreConfigError

    wrong = store_url.replace(store_url.split("@")[0].split("//")[1], ":wrong")
    for url, cause in (
        (wrong, "refused this client's credentials"),
        (f"grpc://127.0.0.1:{free_port()}", "does not answer"),
    ):
        with pytest.raises(StoreConfigError, match=cause) as e:
            _backend(url, _host_pool(), "ns")
        assert ":wrong@" not in str(e.value)


def test_an_emulated_link_is_set_against_the_device_memory_bandwidth(store_url):
    """``?link_ratio=R`` on the backend's URL (a benchmark's slower link) is the device's measured
    memory bandwidth over R, as for the full-KV tier; pages still round trip exactly through it."""
    from remote_store.link import LinkEmulator
    from vericache_sglang.engine.hardware import memory_bandwidth

    host = _host_pool()
    backend = _backend(f"{store_url}?link_ratio=1000", host, f"l{time.monotonic_ns()}")
    assert isinstance(backend.store, LinkEmulator) and backend.store.ratio == 1000
    assert backend.store.bandwidth_bytes_s == memory_bandwidth("cpu") / 1000
    idx, pages = _fill(host, 2, seed=5)
    assert backend.batch_set_v1(["q0", "q1"], idx) == [True, True]
    into = host.alloc(2 * PAGE)
    assert backend.batch_get_v1(["q0", "q1"], into) == [True, True]
    for i, page in enumerate(pages):
        assert torch.equal(host.get_data_page(int(into[i * PAGE])), page)
    assert backend.store.transfer_s > 0


def test_storage_metrics_are_what_sglang_reads(store_url):
    """SGLang's scheduler (``--enable-metrics``) reads ``get_stats()`` as a ``StorageMetrics`` or None
    and sets its prefetch counts on it; a dict there failed the server's first request. Our own page
    counts are ``page_stats()``."""
    from sglang.srt.observability.metrics_collector import StorageMetrics

    backend = _backend(store_url, _host_pool(), f"m{time.monotonic_ns()}")
    assert backend.get_stats() is None or isinstance(backend.get_stats(), StorageMetrics)
    assert backend.page_stats()["set"] == 0
