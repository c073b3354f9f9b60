"""Every backend on real services (memory, redis-server, our gRPC store server): bit-exact round
trips, cross-process reads, VeriCache identity, auth and TLS."""

import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch
from services import REPO, RedisCluster, RedisServer, StoreServer, redis_available, self_signed_cert

from remote_store import StoreError, codec, open_store
from vericache_sglang.core.compress import parse_spec
from vericache_sglang.core.kv import KVLayout
from vericache_sglang.engine.decode import GenerationConfig, generate_full, generate_vericache
from vericache_sglang.engine.engine import compare
from vericache_sglang.engine.prefill import prefill
from vericache_sglang.full_kv.store import FullKVStore

pytestmark = pytest.mark.service

needs_redis = pytest.mark.skipif(not redis_available(), reason="redis-server is not installed")


def layout(dtype=torch.float32):
    return KVLayout("m@1", num_layers=3, num_kv_heads=2, head_dim=16, dtype=dtype)


def random_kv(lay, n, seed):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(2, n, 16, generator=g).to(lay.dtype), torch.randn(2, n, 16, generator=g).to(lay.dtype))
        for _ in range(lay.num_layers)
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fullkv_roundtrip_bit_exact(backend_url, dtype):
    lay = layout(dtype)
    store = FullKVStore(open_store(backend_url), lay, namespace=uuid.uuid4().hex, chunk_tokens=32)
    tokens = list(range(1000, 1100))
    req = store.open_request(tokens)
    kv = random_kv(lay, 100, seed=1)
    req.write(0, kv)
    more = random_kv(lay, 7, seed=2)
    req.extend_tokens(range(7))
    req.write(100, more)
    got = {layer: (k, v) for layer, k, v in req.fetch_layers()}
    for layer in range(3):
        assert torch.equal(got[layer][0], torch.cat([kv[layer][0], more[layer][0]], 1))
        assert torch.equal(got[layer][1], torch.cat([kv[layer][1], more[layer][1]], 1))
    assert store.longest_prefix(tokens) == 96
    req.release()
    store.backend.close()


def test_packed_quantized_payload_roundtrip(backend_url):
    c = parse_spec("kivi:bits=2,group=16,residual=16")
    k = torch.randn(2, 64, 16)
    layer = c.compress_layer(0, k, torch.randn(2, 64, 16), None)
    payload = b"".join(
        t.contiguous().view(torch.uint8).numpy().tobytes()
        for t in (*layer.k_blocks.codes, *layer.k_blocks.scales, *layer.v_blocks.codes)
    )
    header = codec.ChunkHeader(
        codec.KIND_PACKED, "uint8", 0, 2, 64, 16, 0, "0123456789abcdef", b"p" * 16, 0, len(payload)
    )
    backend = open_store(backend_url)
    key = f"test:packed:{uuid.uuid4().hex}"
    backend.put_many([(key, codec.encode(header, payload))])
    got_header, got = codec.decode(backend.get_many([key])[0])
    assert bytes(got) == payload and got_header.kind == codec.KIND_PACKED
    backend.delete_many([key])
    backend.close()


WRITER = """
import sys, torch
sys.path[:0] = [{here!r}, {tests!r}]  # this file's folder, and tests/ for its helpers
from test_store_backends import layout, random_kv
from remote_store import open_store
from vericache_sglang.full_kv.store import FullKVStore
store = FullKVStore(open_store({url!r}), layout(), namespace={ns!r}, chunk_tokens=32)
req = store.open_request(list(range(64)))
req.write(0, random_kv(layout(), 64, seed=9))
print("written")
"""


@pytest.mark.parametrize("which", ["redis", "grpc"])
def test_cross_process_read(request, which):
    if which == "redis" and not redis_available():
        pytest.skip("redis-server is not installed")
    url = request.getfixturevalue("redis_url" if which == "redis" else "store_url")
    ns = uuid.uuid4().hex
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            WRITER.format(here=str(Path(__file__).parent), tests=str(REPO / "tests"), url=url, ns=ns),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and "written" in done.stdout, done.stderr
    store = FullKVStore(open_store(url), layout(), namespace=ns, chunk_tokens=32)
    assert store.longest_prefix(list(range(64))) == 64
    prefix = store.load_prefix(list(range(64)), 64)
    expected = random_kv(layout(), 64, seed=9)
    for layer in range(3):
        assert torch.equal(prefix.layers[layer][0], expected[layer][0])


@pytest.fixture(scope="module")
def tiny_pre(tiny_runner):
    prompt = torch.randint(0, 512, (200,), generator=torch.Generator().manual_seed(11)).tolist()
    return prefill(tiny_runner, prompt)


@pytest.fixture(scope="module")
def tiny_ref(tiny_runner, tiny_pre):
    return generate_full(tiny_runner, tiny_pre, GenerationConfig(max_new_tokens=40, keep_logits=True))


def test_vericache_identical_on_each_backend(tiny_runner, tiny_pre, tiny_ref, backend_url, exactness):
    store = FullKVStore(open_store(backend_url), tiny_runner.layout, namespace=uuid.uuid4().hex, chunk_tokens=32)
    res = generate_vericache(
        tiny_runner,
        tiny_pre,
        parse_spec("snapkv:ratio=0.25,window=16"),
        store,
        GenerationConfig(max_new_tokens=40, keep_logits=True, horizon=8),
    )
    cmp = compare(tiny_ref, res)
    exactness(f"tiny greedy via {backend_url.split(':')[0]}", cmp)
    assert cmp["identical"], cmp
    assert res.stats.fetch_bytes and all(b > 0 for b in res.stats.fetch_bytes)


def test_grpc_auth_refuses_missing_or_wrong_token(tmp_path):
    server = StoreServer(tmp_path, token="s3cret")
    try:
        good = open_store(f"grpc://:s3cret@127.0.0.1:{server.port}")
        good.put_many([("k", b"v")])
        assert good.get_many(["k"]) == [b"v"]
        for url in (f"grpc://127.0.0.1:{server.port}", f"grpc://:wrong@127.0.0.1:{server.port}"):
            with pytest.raises(StoreError, match="UNAUTHENTICATED"):
                open_store(url).get_many(["k"])
            with pytest.raises(StoreError, match="UNAUTHENTICATED"):
                open_store(url).put_many([("k", b"evil")])
        assert good.get_many(["k"]) == [b"v"]  # refused writes changed nothing
    finally:
        server.stop()


def test_grpc_token_from_environment(tmp_path, monkeypatch):
    server = StoreServer(tmp_path, token="from-env")
    try:
        monkeypatch.setenv("VERICACHE_STORE_TOKEN", "from-env")
        store = open_store(f"grpc://127.0.0.1:{server.port}")
        store.put_many([("a", b"1")])
        assert store.get_many(["a"]) == [b"1"]
    finally:
        server.stop()


def test_grpcs_tls(tmp_path):
    cert, key = self_signed_cert(tmp_path)
    server = StoreServer(tmp_path, tls=(cert, key))
    try:
        store = open_store(server.url)
        store.put_many([("t", b"tls")])
        assert store.get_many(["t"]) == [b"tls"]
        with pytest.raises(StoreError):  # plaintext against a TLS port
            open_store(f"grpc://:test-token@127.0.0.1:{server.port}?timeout_s=3").get_many(["t"])
    finally:
        server.stop()


@needs_redis
def test_redis_auth_and_tls(tmp_path):
    cert, key = self_signed_cert(tmp_path)
    server = RedisServer(tmp_path, password="pw", tls=(cert, key, cert))
    try:
        store = open_store(server.url)
        store.put_many([("r", b"tls+auth")])
        assert store.get_many(["r"]) == [b"tls+auth"]
        bad = server.url.replace(":pw@", ":nope@")
        with pytest.raises(StoreError):
            open_store(bad).get_many(["r"])
    finally:
        server.stop()


@needs_redis
def test_a_redis_cluster_spreads_records_pins_on_their_node_and_a_dead_node_is_a_store_error(tmp_path):
    """Records over a real three-primary Redis Cluster: each on the node that owns its slot, its pin
    counter beside it (the pin scripts run on that node), batches split by node; with one node
    killed, a batch touching its slots is a StoreError (never a wrong or partial answer), and
    the other nodes' records still read."""
    import redis

    from remote_store.health import probe

    cluster = RedisCluster(tmp_path)
    try:
        probe(cluster.url)
        store = open_store(cluster.url)
        items = [(f"vc:t:{i}", bytes([i]) * 64) for i in range(60)]
        store.put_many(items, ttl_s=600)
        keys = [k for k, _ in items]
        assert store.get_many(keys) == [v for _, v in items]
        assert store.get_ranges([(keys[3], [(1, 2)])]) == [[bytes([3]) * 2]]
        nodes = [redis.Redis(port=p) for p in cluster.ports]
        held = [n.dbsize() for n in nodes]
        assert all(h > 0 for h in held) and sum(held) == 60, held  # spread over every primary
        store.pin(keys[:10])
        slots = redis.RedisCluster(host="127.0.0.1", port=cluster.ports[0])
        owner = {k: nodes[cluster.ports.index(slots.get_node_from_key(k).port)] for k in keys}
        assert all(owner[k].ttl(k) == -1 for k in keys[:10])  # pinned: no TTL, on the record's node
        assert all(owner[k].exists(f"pin:{{{k}}}") for k in keys[:10])  # the counter beside it
        store.unpin(keys[:10])
        assert all(owner[k].ttl(k) > 0 for k in keys[:10])
        assert store.stats()["keys"] == 60 and store.stats()["nodes"] == 3
        assert store.delete_many(keys[50:]) == 10 and store.exists_many(keys[50:]) == [False] * 10
        assert all(owner[k].exists(k) for k in keys[:50])
        on_dead = [k for k in keys[:50] if owner[k] is nodes[1]]
        cluster.kill(1)
        with pytest.raises(StoreError):
            store.get_many(keys[:50])
        alive = [k for k in keys[:50] if k not in on_dead]
        assert on_dead and store.get_many(alive) == [dict(items)[k] for k in alive]
    finally:
        cluster.stop()


def test_server_needs_no_torch_and_shuts_down_gracefully(tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, remote_store.server, remote_store.backends.grpc; "
            "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] == 'torch')))".replace(
                "import sys,", "import json, sys,"
            ),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == []
    server = StoreServer(tmp_path)
    assert server.stop() == 0
    assert b"stopped" in (tmp_path / "server.log").read_bytes()


def test_unknown_scheme_is_a_clear_error():
    with pytest.raises(ValueError, match="supported schemes"):
        open_store("s3://bucket")
    with pytest.raises(ValueError, match="expected grpc"):
        open_store("grpc://nohost")


@pytest.mark.parametrize(
    "spec", ["snapkv:ratio=0.5,window=8", "streamingllm:sink=4,window=40", "kivi:bits=2,group=16,residual=32"]
)
def test_subset_fetch_moves_only_rows_not_held(backend_url, spec):
    from vericache_sglang.core.compress.observation import Observation
    from vericache_sglang.core.kv import FullKV

    lay = layout()
    n = 150
    kv = random_kv(lay, n, seed=4)
    ckv = parse_spec(spec).compress(FullKV(lay, kv), Observation([torch.randn(4, 64, 16) for _ in range(3)]))
    store = FullKVStore(
        open_store(backend_url), lay, namespace=uuid.uuid4().hex, chunk_tokens=32, subset_min_fraction=0.0
    )
    req = store.open_request(list(range(n)))
    req.write(0, kv)
    whole = {layer: (k.clone(), v.clone()) for layer, k, v in req.fetch_layers(n)}
    whole_bytes = req.stats.last_fetch_bytes
    part = {layer: (k, v) for layer, k, v in req.fetch_layers(n, held=lambda i: ckv.layers[i].exact_kv())}
    part_bytes = req.stats.last_fetch_bytes
    for layer in range(3):
        assert torch.equal(part[layer][0], kv[layer][0]) and torch.equal(part[layer][1], kv[layer][1])
        assert torch.equal(whole[layer][0], kv[layer][0])
    held = sum(ckv.layers[i].exact_kv()[0].numel() for i in range(3)) / (3 * 2 * n)
    # rows held are not moved (within the headers, checksums and merged gaps the ranges add)
    assert part_bytes < whole_bytes * (1 - held) * 1.15, (part_bytes, whole_bytes, held)
    # a token range
    sub = {layer: k for layer, k, _ in req.fetch_layers(100, start=40)}
    assert torch.equal(sub[2], kv[2][0][:, 40:100])


def test_subset_fetch_detects_a_corrupt_row(redis_url):
    import redis as redis_py

    from vericache_sglang.core.compress.observation import Observation
    from vericache_sglang.core.kv import FullKV

    lay = layout()
    kv = random_kv(lay, 64, seed=5)
    ckv = parse_spec("snapkv:ratio=0.5,window=8").compress(
        FullKV(lay, kv), Observation([torch.randn(4, 64, 16) for _ in range(3)])
    )
    store = FullKVStore(
        open_store(redis_url), lay, namespace=uuid.uuid4().hex, chunk_tokens=32, subset_min_fraction=0.0
    )
    req = store.open_request(list(range(64)))
    req.write(0, kv)
    key = store.key(store.refs(req.tokens, 64)[0], 1)
    client = redis_py.Redis.from_url(redis_url)
    record = bytearray(client.get(key))
    held_pos = set(ckv.layers[1].exact_kv()[0][0].tolist())
    token = next(t for t in range(32) if t not in held_pos)  # a row that must be fetched
    record[codec.HEADER_SIZE + token * 16 * 4 + 3] ^= 0x10  # head 0, K
    client.set(key, bytes(record))
    with pytest.raises(codec.ChunkError, match="checksum mismatch in row"):
        list(req.fetch_layers(64, held=lambda i: ckv.layers[i].exact_kv()))


def test_identical_through_the_remote_link_ratio(exactness):
    """The paper's remote link (1.2 GB/s against an H100's HBM): a link thousands of times slower than
    this machine's memory. Real bytes move; only the rest of the emulated time is slept."""
    from vericache_sglang.engine.engine import Engine

    engine = Engine("tiny", store="memory://?link_ratio=3000")
    tokens = torch.randint(0, 512, (160,), generator=torch.Generator().manual_seed(2)).tolist()
    pre = engine.prefill(tokens)
    cfg = engine.config(max_new_tokens=24, keep_logits=True, horizon=8)
    ref = engine.generate(pre, "full", cfg=cfg)
    res = engine.generate(pre, "vericache", "streamingllm:sink=4,window=32", cfg)
    cmp = compare(ref, res)
    exactness("tiny greedy through a link at ratio 3000", cmp)
    assert cmp["identical"], cmp
    link = engine.store_report()
    assert link["link_ratio"] == 3000
    assert link["link_bandwidth_bytes_s"] == pytest.approx(link["memory_bandwidth_bytes_s"] / 3000)
    assert link["link_bytes_moved"] > 0 and link["link_transfer_s"] > 0
