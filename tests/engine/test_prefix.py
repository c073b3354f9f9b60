"""Remote prefix caching on the tiny model: a registered document's compressed KV drafts at once;
the request's own tokens are drafts too, recomputed exactly by the first verification."""

import pytest
import torch

from remote_store.backends.memory import MemoryStore
from vericache_sglang.core.compress import parse_spec
from vericache_sglang.core.sampling import SamplingParams
from vericache_sglang.engine.decode import GenerationConfig, generate_full, generate_vericache_from_prefix
from vericache_sglang.engine.engine import compare
from vericache_sglang.engine.prefill import prefill
from vericache_sglang.engine.prefix import PrefixRegistry
from vericache_sglang.full_kv.store import FullKVStore


@pytest.fixture(scope="module")
def setup(tiny_runner):
    g = torch.Generator().manual_seed(8)
    doc = torch.randint(0, 512, (200,), generator=g).tolist()
    store = FullKVStore(MemoryStore(), tiny_runner.layout, chunk_tokens=32)
    registry = PrefixRegistry(tiny_runner, store, parse_spec("snapkv:ratio=0.25,window=16"))
    prefix = registry.register(doc)
    questions = [torch.randint(0, 512, (int(n),), generator=g).tolist() for n in (9, 23, 1)]
    return store, registry, prefix, doc, questions


@pytest.mark.parametrize("qi", [0, 1, 2])
@pytest.mark.parametrize("sampled", [False, True])
def test_prefix_request_identical_to_full_kv(tiny_runner, setup, qi, sampled, exactness):
    store, registry, prefix, doc, questions = setup
    prompt = doc + questions[qi]
    assert registry.match(prompt) is prefix and len(prefix.tokens) == 192  # whole chunks of 32
    sampling = SamplingParams(temperature=0.8, seed=4) if sampled else SamplingParams()
    cfg = GenerationConfig(max_new_tokens=30, horizon=6, keep_logits=True, sampling=sampling)
    # the reference: the stored prefix's full KV, the rest prefilled exactly, full-KV decoding
    ref = generate_full(tiny_runner, prefill(tiny_runner, prompt, prefix=store.load_prefix(prompt, 192)), cfg)
    res, req = generate_vericache_from_prefix(tiny_runner, prefix, prompt, registry.compressor, store, cfg)
    cmp = compare(ref, res)
    exactness(f"tiny prefix request q={len(questions[qi]) + 8} {'sampled' if sampled else 'greedy'}", cmp)
    assert cmp["identical"], cmp
    assert req.first_token_s is not None
    assert prefix.ckv.tokens_per_layer()[0] == 48  # the registered copy is untouched by requests


def test_prefix_must_be_in_the_store(tiny_runner, setup):
    _store, registry, prefix, doc, questions = setup
    other = FullKVStore(MemoryStore(), tiny_runner.layout, chunk_tokens=32)
    with pytest.raises(Exception, match="not \\(all\\) in the store"):
        generate_vericache_from_prefix(
            tiny_runner, prefix, doc + questions[0], registry.compressor, other, GenerationConfig(max_new_tokens=4)
        )


@pytest.mark.parametrize(
    "spec",
    [
        "snapkv:ratio=0.0625,window=16+refresh:ratio=0.1875,span=4+lookup:min_ngram=1",
        "h2o:ratio=0.125+refresh:ratio=0.125+lookup:min_ngram=1,trust=1",
    ],
)
def test_prefix_requests_with_drafting_modifiers_are_identical(tiny_runner, setup, spec, exactness):
    """The RAG setting with refresh and lookup: the document's refreshed rows start from its own
    last queries, then each verification re-chooses them over the document and the request."""
    store, _registry, _prefix, doc, questions = setup
    registry = PrefixRegistry(tiny_runner, store, parse_spec(spec))
    prefix = registry.register(doc)
    before = [(layer.positions.clone(), layer.rows) for layer in prefix.ckv.layers]
    prompt = doc + questions[1] + doc[40:60]  # the request repeats part of the document: lookup proposes
    cfg = GenerationConfig(max_new_tokens=40, horizon=8, keep_logits=True)
    ref = generate_full(tiny_runner, prefill(tiny_runner, prompt, prefix=store.load_prefix(prompt, 192)), cfg)
    res, _req = generate_vericache_from_prefix(tiny_runner, prefix, prompt, registry.compressor, store, cfg)
    cmp = compare(ref, res)
    exactness(f"tiny prefix request {spec}", cmp, mean_accepted_length=res.stats.mean_accepted_length)
    assert cmp["identical"], cmp
    assert len(res.stats.draft_forwards) == len(res.stats.committed) and sum(res.stats.draft_forwards) > 0
    for layer, (positions, rows) in zip(prefix.ckv.layers, before, strict=True):
        assert torch.equal(layer.positions, positions) and layer.rows == rows  # the registered copy is untouched
