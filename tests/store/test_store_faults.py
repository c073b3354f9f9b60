"""Faults on real servers, during real generations (tiny model): the request fails with a clear
error or falls back to recomputing; no unverified token is ever emitted; the store keeps serving.

Each test starts servers of its own, since it kills, restarts, corrupts or fills them.
"""

import time
import uuid

import pytest
import redis
import torch
from faults import HookedStore
from services import RedisServer, StoreServer, redis_available

from remote_store import StoreError, open_store
from vericache_sglang.core.compress import parse_spec
from vericache_sglang.engine.decode import GenerationConfig, generate_full, generate_vericache
from vericache_sglang.engine.engine import compare
from vericache_sglang.engine.fetch import FetchError
from vericache_sglang.engine.prefill import prefill
from vericache_sglang.full_kv.store import FullKVStore

pytestmark = pytest.mark.service
needs_redis = pytest.mark.skipif(not redis_available(), reason="redis-server is not installed")

SPEC = "snapkv:ratio=0.25,window=16"
NEW = 40


@pytest.fixture(scope="module")
def pre(tiny_runner):
    prompt = torch.randint(0, 512, (200,), generator=torch.Generator().manual_seed(21)).tolist()
    return prefill(tiny_runner, prompt)


@pytest.fixture(scope="module")
def ref(tiny_runner, pre):
    return generate_full(tiny_runner, pre, GenerationConfig(max_new_tokens=NEW, keep_logits=True))


def run(tiny_runner, pre, backend, on_commit=None, **cfg):
    store = FullKVStore(backend, tiny_runner.layout, namespace=uuid.uuid4().hex, chunk_tokens=32)
    cfg.setdefault("horizon", 6)
    return generate_vericache(
        tiny_runner,
        pre,
        parse_spec(SPEC),
        store,
        GenerationConfig(max_new_tokens=NEW, keep_logits=True, **cfg),
        on_commit=on_commit,
    ), store


def after_commits(k, action):
    """An on_commit hook that runs ``action`` once, after the k-th commit."""
    state = {"n": 0}

    def hook(tokens):
        state["n"] += 1
        if state["n"] == k:
            action()

    return hook


def assert_serves(url):
    probe = open_store(url)
    key = f"probe:{uuid.uuid4().hex}"
    probe.put_many([(key, b"still serving")])
    assert probe.get_many([key]) == [b"still serving"]


def test_store_server_killed_mid_fetch(tiny_runner, pre, ref, tmp_path, exactness):
    server = StoreServer(tmp_path)
    layers = tiny_runner.layout.num_layers
    try:
        # Kill the server between layer 1 and layer 2 of the third verification's fetch.
        kill_at = 2 * layers + 3
        backend = HookedStore(open_store(server.url), lambda n: server.kill() if n == kill_at else None)
        emitted = []
        with pytest.raises(FetchError, match="no unverified token"):
            run(tiny_runner, pre, backend, on_commit=emitted.extend, on_store_error="fail")
        assert emitted == ref.tokens[: len(emitted)] and 1 < len(emitted) < NEW
        server.start()
        backend = HookedStore(open_store(server.url), lambda n: server.kill() if n == kill_at else None)
        res, _ = run(tiny_runner, pre, backend)
        cmp = compare(ref, res)
        exactness("tiny greedy, gRPC store killed mid-fetch, recompute", cmp)
        assert cmp["identical"] and res.stats.store_fallbacks == 1
        server.start()
        assert_serves(server.url)  # it comes back and serves others
    finally:
        server.stop()


@needs_redis
def test_redis_restarted_during_generation(tiny_runner, pre, ref, tmp_path, exactness):
    server = RedisServer(tmp_path)
    try:
        res, _ = run(tiny_runner, pre, open_store(server.url), on_commit=after_commits(3, server.restart))
        cmp = compare(ref, res)
        exactness("tiny greedy, redis restarted (data lost), recompute", cmp)
        assert cmp["identical"] and res.stats.store_fallbacks == 1
        assert_serves(server.url)
    finally:
        server.stop()


def _request_keys(store):
    client_keys = []
    backend = store.backend
    inner = getattr(backend, "client", None)
    if inner is not None:
        client_keys = [k.decode() for k in inner.scan_iter(f"vc1:{store.namespace}:*")]
    return client_keys


@needs_redis
@pytest.mark.parametrize("damage", ["flip_byte", "foreign_chunk", "missing_key"])
def test_damaged_chunk_is_refused(tiny_runner, pre, ref, tmp_path, damage, exactness):
    server = RedisServer(tmp_path)
    client = redis.Redis.from_url(server.url)
    holder = {}

    def hurt():
        store = holder["store"]
        # layer-1 prompt chunks (shared ones: a request's tail chunk is rewritten on every commit)
        keys = sorted(k for k in _request_keys(store) if k.endswith(":1") and ":shared:" in k)
        target = keys[0]
        if damage == "flip_byte":
            value = bytearray(client.get(target))
            value[len(value) // 2] ^= 0x01
            client.set(target, bytes(value))
        elif damage == "foreign_chunk":
            client.set(target, client.get(keys[1]))  # a well-formed chunk of another prefix
        else:
            client.delete(target)

    try:
        backend = open_store(server.url)
        # Whole-record reads: which chunk is damaged depends on the (random) namespace, and a row-subset
        # read rightly ignores damage to rows it does not need (test_store_backends covers that path).
        store = FullKVStore(
            backend, tiny_runner.layout, namespace=uuid.uuid4().hex, chunk_tokens=32, subset_min_fraction=2.0
        )
        holder["store"] = store
        emitted = []
        damage_once = after_commits(2, hurt)  # after the first verification: the prompt is stored
        with pytest.raises(FetchError) as e:
            generate_vericache(
                tiny_runner,
                pre,
                parse_spec(SPEC),
                store,
                GenerationConfig(max_new_tokens=NEW, horizon=6, on_store_error="fail"),
                on_commit=lambda t: (emitted.extend(t), damage_once(t)),
            )
        expected = {"flip_byte": "checksum", "foreign_chunk": "token-prefix digest", "missing_key": "missing"}
        assert expected[damage] in str(e.value)
        assert emitted == ref.tokens[: len(emitted)]
        # the same damage with the recompute policy: identical output
        store = FullKVStore(
            backend, tiny_runner.layout, namespace=uuid.uuid4().hex, chunk_tokens=32, subset_min_fraction=2.0
        )
        holder["store"] = store
        res = generate_vericache(
            tiny_runner,
            pre,
            parse_spec(SPEC),
            store,
            GenerationConfig(max_new_tokens=NEW, horizon=6, keep_logits=True),
            on_commit=after_commits(2, hurt),
        )
        cmp = compare(ref, res)
        exactness(f"tiny greedy, redis chunk damaged ({damage}), recompute", cmp)
        assert cmp["identical"] and res.stats.store_fallbacks == 1
        assert_serves(server.url)
    finally:
        server.stop()


def test_grpc_eviction_under_pressure_spares_pinned_chunks(tiny_runner, pre, ref, tmp_path, exactness):
    # The request's full KV is ~0.3 MB; the server holds 1 MB; another client writes 4 MB meanwhile.
    server = StoreServer(tmp_path, capacity_bytes=1 << 20)
    other = open_store(server.url)
    refused = []

    def flood():
        for i in range(64):
            try:
                other.put_many([(f"flood:{i}", bytes(64 << 10))])
            except StoreError as e:
                refused.append(str(e))

    try:
        res, _ = run(tiny_runner, pre, open_store(server.url), on_commit=after_commits(2, flood))
        cmp = compare(ref, res)
        exactness("tiny greedy, gRPC store flooded, pinned chunks kept", cmp)
        assert cmp["identical"] and res.stats.store_fallbacks == 0  # nothing pinned was evicted
        stats = other.stats()
        assert stats["evictions"] > 0 and stats["bytes"] <= 1 << 20
        assert_serves(server.url)
    finally:
        server.stop()


def test_grpc_store_full_of_pinned_chunks_refuses_clearly(tmp_path):
    server = StoreServer(tmp_path, capacity_bytes=256 << 10)
    try:
        store = open_store(server.url)
        store.pin(["a", "b"])
        store.put_many([("a", bytes(120 << 10)), ("b", bytes(120 << 10))])
        with pytest.raises(StoreError, match=r"RESOURCE_EXHAUSTED.*pinned"):
            store.put_many([("c", bytes(100 << 10))])
        assert store.exists_many(["a", "b", "c"]) == [True, True, False]
        store.unpin(["a"])
        store.put_many([("c", bytes(100 << 10))])
        assert store.exists_many(["a", "b", "c"]) == [False, True, True]
    finally:
        server.stop()


def test_grpc_pins_of_a_client_that_never_unpins_lapse(tmp_path):
    """A client that died holding pins (or lost its unpin with its connection) cannot keep records
    from eviction past the server's pin lease."""
    server = StoreServer(tmp_path, capacity_bytes=256 << 10, pin_ttl_s=1.0)
    try:
        store = open_store(server.url)
        store.pin(["a", "b"])
        store.put_many([("a", bytes(120 << 10)), ("b", bytes(120 << 10))])
        store.close()  # gone without unpinning
        store = open_store(server.url)
        with pytest.raises(StoreError, match=r"RESOURCE_EXHAUSTED.*pinned"):
            store.put_many([("c", bytes(100 << 10))])
        time.sleep(1.2)
        store.put_many([("c", bytes(100 << 10))])
        assert store.exists_many(["a", "b", "c"]) == [False, True, True]
        assert store.stats()["pins_expired"] == 2
    finally:
        server.stop()


@needs_redis
def test_redis_eviction_under_pressure_spares_pinned_chunks(tiny_runner, pre, ref, tmp_path, exactness):
    server = RedisServer(tmp_path, maxmemory="3mb")
    other = open_store(server.url)
    oom = []

    def flood():
        for i in range(48):
            try:
                other.put_many([(f"flood:{i}", bytes(64 << 10))], ttl_s=600)
            except StoreError as e:
                oom.append(str(e))

    try:
        res, _ = run(tiny_runner, pre, open_store(server.url), on_commit=after_commits(2, flood))
        cmp = compare(ref, res)
        exactness("tiny greedy, redis flooded (volatile-lru), pinned chunks kept", cmp)
        assert cmp["identical"] and res.stats.store_fallbacks == 0
        assert other.stats()["evictions"] > 0
        assert_serves(server.url)
    finally:
        server.stop()


@needs_redis
def test_redis_full_of_pinned_records_refuses_writes_and_can_still_unpin(tmp_path):
    server = RedisServer(tmp_path, maxmemory="2mb")
    try:
        store = open_store(server.url)
        written = []
        with pytest.raises(StoreError, match="maxmemory"):
            for i in range(64):
                store.pin([f"p{i}"])
                store.put_many([(f"p{i}", bytes(64 << 10))], ttl_s=600)
                written.append(f"p{i}")
        assert all(store.exists_many(written))  # nothing pinned was evicted
        store.unpin([*written, f"p{len(written)}"])  # allowed at maxmemory: releasing must always work
        store.put_many([("after", b"room again")], ttl_s=600)  # unpinned records are evictable again
        assert store.get_many(["after"]) == [b"room again"]
    finally:
        server.stop()
