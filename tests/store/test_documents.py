"""Shared documents on the tiny model: the store's catalog, two registries sharing one store (one
registers, the other adopts from the catalog), and the batch engine starting requests over a
document's compressed copy with output identical to full-KV decoding."""

import pytest
import torch

from remote_store.backends.memory import MemoryStore
from vericache_sglang.core.compress import describe_compressors, parse_spec
from vericache_sglang.engine.batch import BatchEngine
from vericache_sglang.engine.batch_jobs import BatchConfig
from vericache_sglang.engine.decode import GenerationConfig, generate_full, generate_vericache_from_prefix
from vericache_sglang.engine.engine import compare
from vericache_sglang.engine.prefill import prefill
from vericache_sglang.engine.prefix import PrefixRegistry, store_document
from vericache_sglang.full_kv.documents import DocumentCatalog, DocumentError
from vericache_sglang.full_kv.store import FullKVStore

CHUNK = 32


@pytest.fixture
def shared(tiny_runner):
    """One byte store; two nodes' views of it (the same layout and namespace)."""
    backend = MemoryStore()
    return [FullKVStore(backend, tiny_runner.layout, "rag", chunk_tokens=CHUNK) for _ in range(2)]


def _doc(seed: int, n: int) -> list[int]:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_catalog_lists_stored_documents(tiny_runner, shared):
    store, other = shared
    doc = _doc(1, 100)
    pre, digest, name = store_document(tiny_runner, store, doc, "manual")
    assert len(pre.tokens) == 96 and name == "manual"  # whole chunks
    cat = DocumentCatalog(other)
    [listed] = cat.documents()
    assert (listed.digest, listed.name, list(listed.tokens)) == (digest, "manual", doc[:96])
    assert cat.get(digest) == listed
    # a document is only listed once its full KV is in the store
    with pytest.raises(Exception, match="holds the full KV of 0"):
        cat.add(_doc(2, 64), "missing")
    assert cat.remove(digest) and cat.documents() == [] and not cat.remove(digest)


def test_catalog_refuses_malformed_records(tiny_runner, shared):
    store, _ = shared
    cat = DocumentCatalog(store)
    store.backend.put_many([(cat.index_key, b"{not json")])
    with pytest.raises(DocumentError, match="not JSON"):
        cat.documents()
    _pre, digest, _ = store_document(
        tiny_runner, FullKVStore(MemoryStore(), tiny_runner.layout, "rag", CHUNK), _doc(3, 64), publish=False
    )
    store.backend.put_many(
        [
            (cat.index_key, f'["{digest}"]'.encode()),
            (cat.record_key(digest), b'{"name": "x", "tokens": [1, 2], "created": 0}'),
        ]
    )
    with pytest.raises(DocumentError, match="whole chunks"):
        cat.documents()
    store.backend.put_many(
        [(cat.record_key(digest), f'{{"name": "x", "tokens": {_doc(4, 64)}, "created": 0}}'.encode())]
    )
    with pytest.raises(DocumentError, match="another digest"):
        cat.documents()
    store.backend.put_many([(cat.record_key(digest), b'{"name": "x"}')])
    with pytest.raises(DocumentError, match="malformed"):
        cat.documents()


def test_a_second_registry_adopts_documents_from_the_store(tiny_runner, shared):
    node_a, node_b = (PrefixRegistry(tiny_runner, s, parse_spec("knorm:ratio=0.25")) for s in shared)
    doc = _doc(4, 130)
    mine = node_a.register(doc, "doc-a", publish=True)
    adopted, dropped = node_b.sync()
    assert [p.digest for p in adopted] == [mine.digest] and dropped == []
    theirs = node_b.by_digest[mine.digest]
    assert theirs.tokens == mine.tokens and theirs.name == "doc-a"
    for (ka, va), (kb, vb) in zip(
        (lay.read() for lay in mine.ckv.layers), (lay.read() for lay in theirs.ckv.layers), strict=True
    ):
        assert torch.equal(ka, kb) and torch.equal(va, vb)  # key norms: the same choice on both nodes
    question = _doc(5, 11)
    assert node_b.match(doc[:128] + question) is theirs
    assert node_b.match(doc[:128]) is None  # nothing left to decode after it
    assert node_b.match(question + doc) is None
    assert node_b.sync() == ([], [])
    DocumentCatalog(shared[0]).remove(mine.digest)
    assert node_b.sync() == ([], [mine.digest]) and node_b.match(doc[:128] + question) is None


def test_registry_budget_skips_what_does_not_fit(tiny_runner, shared):
    store_a, store_b = shared
    PrefixRegistry(tiny_runner, store_a, parse_spec("knorm:ratio=0.5")).register(_doc(6, 64), publish=True)
    small = PrefixRegistry(tiny_runner, store_b, parse_spec("knorm:ratio=0.5"), max_bytes=1000)
    assert small.sync() == ([], []) and "budget" in next(iter(small.skipped.values()))


def test_every_compressor_says_how_it_scores_a_shared_document():
    table = {c["name"]: c["document_scoring"] for c in describe_compressors()}
    for agnostic in ("kvzip", "knorm", "streamingllm"):
        assert table[agnostic].startswith("query-agnostic")
    assert "own queries" in table["snapkv"] and "quantized" in table["kivi"]
    assert parse_spec("snapkv+kivi").document_scoring == table["snapkv"]


@pytest.mark.parametrize(
    "spec",
    ["knorm:ratio=0.25", "snapkv:ratio=0.25,window=16", pytest.param("kivi:bits=2,group=16", marks=pytest.mark.slow)],
)
def test_batch_engine_starts_requests_over_a_document(tiny_runner, shared, spec, exactness):
    store, other = shared
    PrefixRegistry(tiny_runner, store, parse_spec(spec)).register(_doc(7, 200), "d", publish=True)
    node = PrefixRegistry(tiny_runner, other, parse_spec(spec))
    [prefix] = node.sync()[0]
    gen = GenerationConfig(max_new_tokens=24, horizon=5, keep_logits=True)
    engine = BatchEngine(tiny_runner, other, parse_spec("streamingllm"), BatchConfig(kv_budget_bytes=1 << 28), gen)
    prompts = [_doc(7, 200)[:192] + _doc(10 + i, n) for i, n in enumerate((1, 9, 40))]
    for i, p in enumerate(prompts):
        engine.submit_prefixed(p, node.match(p), f"r{i}")
    plain = _doc(20, 50)
    engine.submit(prefill(tiny_runner, plain), "plain")
    results = engine.run()
    for i, p in enumerate(prompts):
        ref = generate_full(tiny_runner, prefill(tiny_runner, p, prefix=other.load_prefix(p, 192)), gen)
        cmp = compare(ref, results[f"r{i}"])
        exactness(f"tiny batch over a shared document {spec} q={len(p) - 192}", cmp)
        assert cmp["identical"], cmp
        alone, _ = generate_vericache_from_prefix(tiny_runner, prefix, p, prefix.compressor, other, gen)
        assert alone.tokens == results[f"r{i}"].tokens
    ref = generate_full(tiny_runner, prefill(tiny_runner, plain), gen)
    assert compare(ref, results["plain"])["identical"]
    assert prefix.ckv.tokens_per_layer() == node.by_digest[prefix.digest].ckv.tokens_per_layer()


def test_prefixed_request_must_start_with_its_document(tiny_runner, shared):
    store, _ = shared
    prefix = PrefixRegistry(tiny_runner, store, parse_spec("knorm")).register(_doc(8, 64))
    engine = BatchEngine(tiny_runner, store, parse_spec("knorm"), BatchConfig(), GenerationConfig())
    with pytest.raises(ValueError, match="does not start with"):
        engine.submit_prefixed(_doc(9, 80), prefix, "x")
    lossy = BatchEngine(tiny_runner, store, parse_spec("knorm"), BatchConfig(mode="lossy"), GenerationConfig())
    with pytest.raises(ValueError, match="needs mode 'vericache'"):
        lossy.submit_prefixed([*_doc(8, 64), 1], prefix, "x")


def test_a_document_the_store_cannot_serve_yet_is_tried_again(tiny_runner, shared):
    store_a, store_b = shared
    doc = _doc(11, 96)
    _pre, digest, _ = store_document(tiny_runner, store_a, doc, "flaky")
    key = store_a.key(store_a.refs(doc)[-1], 0)
    saved = store_a.backend.get_many([key])[0]
    store_a.backend.delete_many([key])  # one chunk-layer lost
    node = PrefixRegistry(tiny_runner, store_b, parse_spec("knorm:ratio=0.5"))
    assert node.sync() == ([], []) and digest not in node.skipped
    store_a.backend.put_many([(key, saved)])
    [adopted] = node.sync()[0]
    assert adopted.digest == digest
