import time

import pytest
import torch
from faults import HookedStore

from remote_store import open_store
from remote_store.backends.base import StoreError
from remote_store.backends.memory import MemoryStore, default_capacity_bytes
from remote_store.codec import ChunkError
from vericache_sglang.core.kv import KVLayout
from vericache_sglang.full_kv.store import FullKVStore


def layout(dtype=torch.float32, model="m@1"):
    return KVLayout(model, num_layers=3, num_kv_heads=2, head_dim=8, dtype=dtype)


def kv_span(lay: KVLayout, n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(2, n, 8, generator=g).to(lay.dtype), torch.randn(2, n, 8, generator=g).to(lay.dtype))
        for _ in range(lay.num_layers)
    ]


def fetch_all(req, upto=None):
    return {layer: (k, v) for layer, k, v in req.fetch_layers(upto)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_request_roundtrip_across_chunks_bit_exact(dtype):
    lay = layout(dtype)
    store = FullKVStore(MemoryStore(), lay, chunk_tokens=16)
    prompt = list(range(100, 140))  # 40 tokens: 2 whole chunks + a tail of 8
    req = store.open_request(prompt)
    kv = kv_span(lay, 40)
    req.write(0, kv)
    got = fetch_all(req)
    for layer in range(3):
        assert torch.equal(got[layer][0], kv[layer][0]) and torch.equal(got[layer][1], kv[layer][1])
    # decode: the tail chunk grows in place, then spills into a new chunk
    more = kv_span(lay, 13, seed=1)
    req.extend_tokens(range(500, 513))
    req.write(40, more)
    got = fetch_all(req)
    for layer in range(3):
        assert torch.equal(got[layer][0], torch.cat([kv[layer][0], more[layer][0]], 1))
    assert req.stats.fetch_bytes_per_verify[-1] > 0


def test_superseded_tail_is_deleted_and_release_keeps_shared():
    lay = layout()
    backend = MemoryStore()
    store = FullKVStore(backend, lay, chunk_tokens=16)
    req = store.open_request(list(range(40)))
    req.write(0, kv_span(lay, 40))
    keys_before = backend.stats()["keys"]
    req.extend_tokens([7, 8])
    req.write(40, kv_span(lay, 2, seed=2))
    assert backend.stats()["keys"] == keys_before  # the 8-token tail was replaced by the 10-token one
    req.release()
    assert backend.stats()["keys"] == 2 * 3  # the two shared prompt chunks, all layers
    assert store.longest_prefix(list(range(40))) == 32
    assert store.longest_prefix([*range(40), 1, 2]) == 32
    assert store.longest_prefix([9, *range(1, 40)]) == 0  # a different first token


def test_prefix_reuse_loads_exact_kv_and_skips_existing_writes():
    lay = layout()
    backend = MemoryStore()
    store = FullKVStore(backend, lay, chunk_tokens=16)
    kv = kv_span(lay, 40)
    store.open_request(list(range(40))).write(0, kv)
    puts = backend.stats()["puts"]
    prefix = store.load_prefix(list(range(40)), 32)
    assert torch.equal(prefix.layers[1][0], kv[1][0][:, :32])
    req2 = store.open_request(list(range(34)))
    calls: list[tuple[str, int]] = []
    for name in ("pin", "exists_many"):
        method = getattr(backend, name)
        setattr(backend, name, lambda keys, _m=method, _n=name: calls.append((_n, len(keys))) or _m(keys))
    req2.write(0, [(k[:, :34], v[:, :34]) for k, v in kv])
    assert backend.stats()["puts"] - puts == 3  # only its own tail chunk (per layer) was written
    # one pin for the write's three chunks (all layers), one existence check for its two shared ones
    assert calls == [("pin", 9), ("exists_many", 6)]


def test_keys_are_salted_by_model_layout_and_namespace():
    backend = MemoryStore()
    a = FullKVStore(backend, layout(model="m@1"), chunk_tokens=16)
    a.open_request(list(range(32))).write(0, kv_span(layout(), 32))
    assert a.longest_prefix(list(range(32))) == 32
    assert FullKVStore(backend, layout(model="m@2"), chunk_tokens=16).longest_prefix(list(range(32))) == 0
    assert FullKVStore(backend, layout(torch.float16), chunk_tokens=16).longest_prefix(list(range(32))) == 0
    other_ns = FullKVStore(backend, layout(model="m@1"), namespace="tenant-b", chunk_tokens=16)
    assert other_ns.longest_prefix(list(range(32))) == 0


def _one_record(store, req):
    ref = store.refs(req.tokens, req.stored)[0]
    key = store.key(ref, 1, None)
    return ref, key


def test_corrupt_or_foreign_chunks_are_refused():
    lay = layout()
    backend = MemoryStore()
    store = FullKVStore(backend, lay, chunk_tokens=16)
    req = store.open_request(list(range(32)))
    req.write(0, kv_span(lay, 32))
    ref, key = _one_record(store, req)
    good = backend.get_many([key])[0]
    flipped = bytearray(good)
    flipped[-5] ^= 0x40
    backend.put_many([(key, bytes(flipped))])
    with pytest.raises(ChunkError, match="checksum"):
        fetch_all(req)
    backend.put_many([(key, good[:40])])
    with pytest.raises(ChunkError, match="shorter than"):
        fetch_all(req)
    backend.put_many([(key, b"XXXX" + good[4:])])
    with pytest.raises(ChunkError, match="magic"):
        fetch_all(req)
    # a well-formed chunk of another token prefix under the right key
    other = store.open_request(list(range(1, 33)))
    other.write(0, kv_span(lay, 32))
    foreign = backend.get_many([store.key(store.refs(other.tokens, 32)[0], 1)])[0]
    backend.put_many([(key, foreign)])
    with pytest.raises(ChunkError, match="token-prefix digest"):
        fetch_all(req)
    # a chunk of another layer under the right key
    backend.put_many([(key, backend.get_many([store.key(ref, 2)])[0])])
    with pytest.raises(ChunkError, match="layer 2"):
        fetch_all(req)
    # another model's chunk with the same tokens
    store_b = FullKVStore(MemoryStore(), layout(model="m@other"), chunk_tokens=16)
    rb = store_b.open_request(list(range(32)))
    rb.write(0, kv_span(lay, 32))
    backend.put_many([(key, store_b.backend.get_many([store_b.key(store_b.refs(rb.tokens, 32)[0], 1)])[0])])
    with pytest.raises(ChunkError, match="another model"):
        fetch_all(req)
    backend.delete_many([key])
    with pytest.raises(StoreError, match="missing"):
        fetch_all(req)


def test_lru_eviction_respects_pins_and_capacity():
    s = MemoryStore(capacity_bytes=1000)
    s.put_many([(f"k{i}", b"x" * 200) for i in range(5)])
    s.pin(["k0"])
    s.get_many(["k1"])  # k1 becomes most recent
    s.put_many([("k5", b"y" * 400)])
    assert s.exists_many(["k0", "k1", "k2", "k3", "k4", "k5"]) == [True, True, False, False, True, True]
    s.pin(["k1", "k4", "k5"])
    with pytest.raises(StoreError, match="pinned"):
        s.put_many([("k6", b"z" * 300)])
    s.unpin(["k4"])
    s.put_many([("k6", b"z" * 200)])
    assert s.exists_many(["k4", "k6"]) == [False, True]
    with pytest.raises(StoreError, match="exceeds"):
        s.put_many([("big", b"b" * 2000)])
    assert s.stats()["evictions"] == 3


def test_ttl_collects_unpinned_records():
    s = MemoryStore()
    s.put_many([("a", b"1"), ("b", b"2")], ttl_s=0.05)
    s.pin(["b"])
    time.sleep(0.08)
    assert s.get_many(["a", "b"]) == [None, b"2"]


def test_a_pin_is_a_lease():
    """A holder that never unpins (a client that died) protects its records until the lease ends;
    one that pins again renews it."""
    s = MemoryStore(capacity_bytes=1000, pin_ttl_s=0.2)
    s.put_many([(f"k{i}", b"x" * 200) for i in range(5)])
    s.pin(["k0", "k1"])
    assert s.stats()["pinned_keys"] == 2
    time.sleep(0.12)
    s.pin(["k1"])  # renewed: k1's lease runs 0.2 s from now, k0's ends in 0.08 s
    time.sleep(0.12)
    s.put_many([("k5", b"y" * 400)])  # the two least recent unpinned records go: k0 (lapsed) and k2
    assert s.exists_many(["k0", "k1", "k2", "k3", "k4", "k5"]) == [False, True, False, True, True, True]
    assert s.stats()["pins_expired"] == 1 and s.stats()["pinned_keys"] == 1
    s.unpin(["k1"])
    s.unpin(["k1"])  # a second unpin of a released pin changes nothing
    assert s.stats()["pinned_keys"] == 0


def test_open_store_urls():
    assert isinstance(open_store("memory://"), MemoryStore)
    assert open_store("memory://?capacity_bytes=123").capacity_bytes == 123
    # a server's embedded store is bounded unless told otherwise: shared prompt chunks have no TTL
    assert open_store("memory://").capacity_bytes == default_capacity_bytes() > 0
    assert open_store("memory://?capacity_bytes=0").capacity_bytes == 0
    assert open_store("memory://?pin_ttl_s=5").pin_ttl_s == 5.0
    with pytest.raises(ValueError, match="capacity_bytes and pin_ttl_s, not capacity"):
        open_store("memory://?capacity=5")
    with pytest.raises(ValueError, match="unknown store URL"):
        open_store("ftp://x")


def test_write_must_be_contiguous():
    lay = layout()
    req = FullKVStore(MemoryStore(), lay, chunk_tokens=16).open_request(list(range(20)))
    with pytest.raises(ValueError, match="positions"):
        req.write(5, kv_span(lay, 3))
    with pytest.raises(ValueError, match="only 20 tokens"):
        req.write(0, kv_span(lay, 25))


class RefusingUnpins(HookedStore):
    """A real memory store whose unpins fail while ``down`` (a store unreachable at release)."""

    def __init__(self, inner: MemoryStore):
        super().__init__(inner, lambda n: None)
        self.down = False

    def unpin(self, keys):
        if self.down:
            raise StoreError("injected: store unreachable")
        self.inner.unpin(keys)

    def delete_many(self, keys):
        if self.down:
            raise StoreError("injected: store unreachable")
        return self.inner.delete_many(keys)


def test_a_release_the_store_refused_is_retried_after_the_next_one():
    lay = layout()
    backend = RefusingUnpins(MemoryStore())
    store = FullKVStore(backend, lay, chunk_tokens=16)
    reqs = []
    for i in range(3):
        req = store.open_request([i, *range(1, 40)])  # two shared chunks and a private tail each
        req.write(0, kv_span(lay, 40, seed=i))
        reqs.append(req)
    backend.down = True
    reqs[0].release()  # refused: the request finished anyway, what it holds is kept
    reqs[1].release()
    # pinned: two shared chunks and the tail, 3 layers each; its own: the tail
    assert reqs[0].unreleased == reqs[1].unreleased == 3 * 3 + 3
    assert backend.inner.stats()["pinned_keys"] == 3 * 3 * 3  # nothing was unpinned
    assert backend.inner.stats()["keys"] == 3 * 3 * 3  # nor deleted
    backend.down = False
    reqs[2].release()  # the store answers again: the two deferred releases follow this one
    assert [r.unreleased for r in reqs] == [0, 0, 0]
    stats = backend.inner.stats()
    assert stats["pinned_keys"] == 0 and stats["keys"] == 3 * 2 * 3  # the shared chunks stay, no tail
