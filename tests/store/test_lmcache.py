"""``lmcache://``: records through the real LMCache 0.5.6 (its engine's storage manager and its Redis
connector), served by the sidecar in its own environment. Skipped where .venv-lmcache is absent."""

import uuid

import pytest
import redis
import torch
from faults import HookedStore
from services import LMCacheSidecar, RedisServer, lmcache_available, redis_available

from remote_store import StoreError, open_store
from vericache_sglang.core.compress import parse_spec
from vericache_sglang.engine.decode import GenerationConfig, generate_full, generate_vericache
from vericache_sglang.engine.engine import compare
from vericache_sglang.engine.fetch import FetchError
from vericache_sglang.engine.prefill import prefill
from vericache_sglang.full_kv.store import FullKVStore

pytestmark = [
    pytest.mark.service,
    pytest.mark.skipif(
        not (lmcache_available() and redis_available()),
        reason="needs .venv-lmcache (scripts/setup_lmcache.sh) and redis-server",
    ),
]


@pytest.fixture
def redis_server(tmp_path):
    (tmp_path / "redis").mkdir()
    server = RedisServer(tmp_path / "redis")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def pre(tiny_runner):
    return prefill(tiny_runner, torch.randint(0, 512, (180,), generator=torch.Generator().manual_seed(4)).tolist())


@pytest.fixture(scope="module")
def ref(tiny_runner, pre):
    return generate_full(tiny_runner, pre, GenerationConfig(max_new_tokens=30, keep_logits=True))


def test_a_second_lmcache_process_reads_what_the_first_wrote(tmp_path, redis_server):
    url = redis_server.url.split("/0")[0]
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first = LMCacheSidecar(tmp_path / "a", url)
    records = [(f"k{i}", bytes(range(256)) * (i + 1) + uuid.uuid4().bytes) for i in range(20)]
    try:
        open_store(first.url).put_many(records)
    finally:
        first.stop()
    second = LMCacheSidecar(tmp_path / "b", url)  # a new LMCache engine, reading Redis through LMCache
    try:
        store = open_store(second.url)
        assert store.get_many([k for k, _ in records]) == [v for _, v in records]
        stats = store.stats()
        assert stats["pins_supported"] == 0 and stats["ttl_supported"] == 0  # what LMCache 0.5.6 cannot do
        # LMCache's own Redis format holds them: a kv_bytes and a metadata key per record
        keys = redis.Redis.from_url(redis_server.url).keys("vericache-records@*")
        assert len(keys) == 2 * len(records)
        with pytest.raises(StoreError, match="UNAUTHENTICATED"):
            open_store(f"lmcache://127.0.0.1:{second.port}").get_many(["k0"])
    finally:
        second.stop()


def test_sidecar_killed_mid_fetch_recomputes(tiny_runner, pre, ref, tmp_path, redis_server, exactness):
    sidecar = LMCacheSidecar(tmp_path, redis_server.url.split("/0")[0])
    try:
        kill_at = 2 * tiny_runner.layout.num_layers + 3
        backend = HookedStore(open_store(sidecar.url), lambda n: sidecar.kill() if n == kill_at else None)
        store = FullKVStore(backend, tiny_runner.layout, namespace=uuid.uuid4().hex, chunk_tokens=32)
        res = generate_vericache(
            tiny_runner,
            pre,
            parse_spec("snapkv:ratio=0.25,window=16"),
            store,
            GenerationConfig(max_new_tokens=30, keep_logits=True, horizon=6),
        )
        cmp = compare(ref, res)
        exactness("tiny greedy, LMCache sidecar killed mid-fetch, recompute", cmp)
        assert cmp["identical"] and res.stats.store_fallbacks == 1
    finally:
        sidecar.stop()


def test_a_corrupted_lmcache_record_is_refused(tiny_runner, pre, ref, tmp_path, redis_server):
    sidecar = LMCacheSidecar(tmp_path, redis_server.url.split("/0")[0])
    client = redis.Redis.from_url(redis_server.url)

    def corrupt_all_records():  # flip one byte in every record LMCache holds
        for key in client.keys("vericache-records@*kv_bytes"):
            value = bytearray(client.get(key))
            value[len(value) // 2] ^= 0x20
            client.set(key, bytes(value))

    try:
        store = FullKVStore(open_store(sidecar.url), tiny_runner.layout, namespace=uuid.uuid4().hex, chunk_tokens=32)
        state = {"n": 0}

        def after_commit(tokens):
            state["n"] += 1
            if state["n"] == 2:
                corrupt_all_records()

        with pytest.raises(FetchError, match="checksum"):
            generate_vericache(
                tiny_runner,
                pre,
                parse_spec("snapkv:ratio=0.25,window=16"),
                store,
                GenerationConfig(max_new_tokens=30, horizon=6, on_store_error="fail"),
                on_commit=after_commit,
            )
    finally:
        sidecar.stop()
