"""Drafting modifiers (issue #16): the n-gram index, spec parsing, verification-guided refresh's rows,
prompt-lookup chains in the engine (exact, and actually drafting), and the replay estimator
against live runs; on the tiny model (the real model's checks are in test_real_model.py)."""

from itertools import pairwise

import pytest
import torch

from remote_store.backends.memory import MemoryStore
from vericache_sglang.bench.acceptance import Trajectory, replay
from vericache_sglang.cli import main as cli_main
from vericache_sglang.core.compress import RECOMMENDED, SpecError, parse_spec
from vericache_sglang.core.compress.refresh import RefreshedLayer
from vericache_sglang.core.lookup import LookupParams, NgramIndex
from vericache_sglang.core.sampling import SamplingParams
from vericache_sglang.engine.decode import GenerationConfig, generate_full, generate_vericache
from vericache_sglang.engine.engine import compare
from vericache_sglang.engine.prefill import prefill
from vericache_sglang.full_kv.store import FullKVStore
from vericache_sglang.sglang.config import VeriCacheConfig, VeriCacheConfigError

REPO_README = __import__("pathlib").Path(__file__).resolve().parents[2] / "README.md"


def test_ngram_index_proposes_the_latest_longest_match_and_never_itself():
    index = NgramIndex(LookupParams(min_ngram=2, max_ngram=3))
    index.extend([1, 2, 3, 9, 1, 2, 3, 7, 5, 2, 3])
    # suffix (1, 2, 3)? no: the history ends in 2, 3 -> latest earlier "2 3" is followed by 7
    assert index.propose([5, 2, 3], limit=11, k=4).tokens == [7, 5, 2, 3]
    # a three-token match wins over a two-token one, and the latest occurrence is taken
    p = index.propose([9, 1, 2, 3], limit=11, k=2)
    assert (p.tokens, p.match) == ([7, 5], 3)
    # the continuation stops at the limit: the committed tokens only
    assert index.propose([1, 2, 3], limit=5, k=8).tokens == [9, 1]
    assert index.propose([4, 4], limit=11, k=3) is None
    assert index.propose([2, 3], limit=11, k=0) is None


def test_spec_modifiers_parse_round_trip_and_refuse_what_is_wrong():
    for spec in (
        RECOMMENDED,
        "snapkv:ratio=0.125+lookup",
        "snapkv:ratio=0.25+kivi:bits=4+refresh:ratio=0.1",
        "h2o:ratio=0.0625+refresh+lookup:trust=4,model=false",
    ):
        c = parse_spec(spec)
        assert parse_spec(c.spec).spec == c.spec
    c = parse_spec(RECOMMENDED)
    assert c.refreshes and c.lookup == LookupParams(trust=0)
    for bad, message in [
        ("lookup", "names no compressor"),
        ("snapkv+lookup+refresh", "order refresh then lookup"),
        ("refresh+snapkv", "go after the compressor"),
        ("snapkv+lookup+lookup", "given twice"),
        ("snapkv+refresh:bogus=1", "refresh has no parameter 'bogus'"),
        ("snapkv+lookup:min_ngram=3,max_ngram=2", "min_ngram <= max_ngram"),
        ("snapkv+refresh:ratio=2", "ratio must be in"),
    ]:
        with pytest.raises(SpecError, match=message):
            parse_spec(bad)


def test_recommended_is_printed_alone_and_is_the_readmes(capsys):
    assert cli_main(["compressors", "--recommended"]) == 0
    assert capsys.readouterr().out == RECOMMENDED + "\n"
    assert RECOMMENDED in REPO_README.read_text()


def test_the_sglang_worker_takes_the_modifiers_wherever_the_full_kv_lives():
    for full_kv in ("device", "store", "host"):
        cfg = VeriCacheConfig(compressor="snapkv:ratio=0.0625+refresh+lookup", full_kv=full_kv)
        assert parse_spec(cfg.compressor).refreshes and parse_spec(cfg.compressor).lookup is not None
    with pytest.raises(VeriCacheConfigError, match=r"\+lookup composed with compressed-KV drafts"):
        VeriCacheConfig(compressor="snapkv:ratio=0.125+lookup:model=False", full_kv="device")
    # an inner compressor that itself scores committed tokens online stays refused
    with pytest.raises(VeriCacheConfigError, match="update_queries"):
        VeriCacheConfig(compressor="h2o:ratio=0.0625+refresh")


@pytest.fixture(scope="module")
def prompt():
    # a prompt that repeats itself, so lookups have something to find
    g = torch.Generator().manual_seed(5)
    block = torch.randint(0, 512, (60,), generator=g).tolist()
    return (block + torch.randint(0, 512, (40,), generator=g).tolist()) * 3


@pytest.fixture(scope="module")
def pre(tiny_runner, prompt):
    return prefill(tiny_runner, prompt, chunk=128)


@pytest.fixture(scope="module")
def reference(tiny_runner, pre):
    return generate_full(tiny_runner, pre, GenerationConfig(max_new_tokens=64, keep_logits=True))


def test_refresh_swaps_in_exact_rows_the_inner_layer_lacks_at_a_fixed_budget(tiny_runner, pre):
    comp = parse_spec("snapkv:ratio=0.125,window=16+refresh:ratio=0.125")
    ckv = comp.compress(pre.kv, pre.obs)
    before = [(layer.rows, layer.nbytes) for layer in ckv.layers]
    n = pre.kv.num_tokens
    queries = [torch.randn(tiny_runner.num_heads, 3, tiny_runner.head_dim) for _ in ckv.layers]
    comp.refresh(ckv, [[(k, v)] for k, v in pre.kv.layers], queries)
    for layer, (k, v), (rows, nbytes) in zip(ckv.layers, pre.kv.layers, before, strict=True):
        assert isinstance(layer, RefreshedLayer)
        assert (layer.rows, layer.nbytes) == (rows, nbytes) and rows == -(-n // 8)
        pos = layer.positions.long()
        idx = pos.unsqueeze(-1).expand(-1, -1, k.shape[-1])
        assert torch.equal(layer.keys, k.gather(1, idx)) and torch.equal(layer.values, v.gather(1, idx))
        held = set(layer.inner.positions[0].tolist())
        assert not held & set(pos[0].tolist())  # nothing taken twice


def test_refresh_never_adds_a_token_a_composition_holds_quantized(tiny_runner, pre):
    # A second, exact copy of a token beside its quantized one would weigh it twice in attention.
    comp = parse_spec("snapkv:ratio=0.5,window=16+kivi:bits=4,group=16,residual=16+refresh:ratio=0.25")
    ckv = comp.compress(pre.kv, pre.obs)
    queries = [torch.randn(tiny_runner.num_heads, 3, tiny_runner.head_dim) for _ in ckv.layers]
    for verified in (False, True):  # the prompt's choice, then a verification's
        if verified:
            comp.refresh(ckv, [[(k, v)] for k, v in pre.kv.layers], queries)
        for layer in ckv.layers:
            assert layer.rows == -(-pre.kv.num_tokens // 4)
            for head, pos in enumerate(layer.positions.tolist()):
                assert not set(layer.inner.positions[head].tolist()) & set(pos)
    with pytest.raises(SpecError, match="a quantizer holds every token"):
        parse_spec("kivi:bits=4+refresh")


def test_refresh_over_a_kv_in_parts_chooses_what_the_whole_kv_would(tiny_runner, pre):
    # The verify path hands the full KV in parts (fetched, then committed rows): never concatenated.
    comp = parse_spec("h2o:ratio=0.125+refresh:ratio=0.125,span=4")
    whole, parted = comp.compress(pre.kv, pre.obs), comp.compress(pre.kv, pre.obs)
    queries = [torch.randn(tiny_runner.num_heads, 5, tiny_runner.head_dim) for _ in whole.layers]
    cuts = (0, 17, 17, pre.kv.num_tokens - 5, pre.kv.num_tokens)  # an empty part and the queries' own rows
    comp.refresh(whole, [[(k, v)] for k, v in pre.kv.layers], queries)
    comp.refresh(parted, [[(k[:, a:b], v[:, a:b]) for a, b in pairwise(cuts)] for k, v in pre.kv.layers], queries)
    for a, b in zip(whole.layers, parted.layers, strict=True):
        assert torch.equal(a.positions, b.positions)
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


@pytest.mark.parametrize(
    "spec",
    [
        "streamingllm:sink=4,window=16+lookup:min_ngram=1",
        "streamingllm:sink=4,window=16+lookup:min_ngram=1,trust=1",
        "snapkv:ratio=0.0625,window=16+refresh:ratio=0.0625+lookup:min_ngram=1,trust=1",
        "streamingllm:sink=4,window=16+lookup:min_ngram=1,model=false",
    ],
)
def test_lookup_drafts_are_exact(tiny_runner, pre, reference, spec, exactness):
    store = FullKVStore(MemoryStore(), tiny_runner.layout, chunk_tokens=32)
    res = generate_vericache(
        tiny_runner, pre, parse_spec(spec), store, GenerationConfig(max_new_tokens=64, keep_logits=True, horizon=8)
    )
    cmp = compare(reference, res)
    exactness(f"tiny repeated-prompt greedy {spec}", cmp)
    assert cmp["identical"], cmp
    # The random model's drafts rarely agree with a lookup (its acceptance is ~1 token), so a chain
    # is drafted here where lookup is trusted; acceptance is measured on SmolLM2 (test_real_model.py).
    if "trust=" in spec or "model=false" in spec:
        assert res.stats.lookup_drafted > 0
    if "model=false" in spec:
        assert res.stats.decode_steps == 0  # prompt lookup alone: no draft forward


@pytest.mark.parametrize("verify", ["exact", "rejection"])
def test_lookup_under_sampling_commits_only_verified_tokens(tiny_runner, pre, verify):
    sampling = SamplingParams(temperature=0.8, top_k=50, seed=7)
    cfg = GenerationConfig(max_new_tokens=48, keep_logits=True, horizon=8, sampling=sampling, verify=verify)
    store = FullKVStore(MemoryStore(), tiny_runner.layout, chunk_tokens=32)
    spec = "streamingllm:sink=4,window=16+lookup:min_ngram=1,trust=1"
    res = generate_vericache(tiny_runner, pre, parse_spec(spec), store, cfg)
    assert len(res.tokens) == 48 and sum(res.stats.committed) == 47
    if verify == "exact":
        assert compare(generate_full(tiny_runner, pre, cfg), res)["identical"]


@pytest.mark.parametrize(
    "spec,x",
    [
        ("snapkv:ratio=0.0625,window=16+refresh:ratio=0.0625", 8),
        ("streamingllm:sink=4,window=16+lookup:min_ngram=1,trust=1", 16),
    ],
)
def test_the_replay_estimator_matches_live_runs(tiny_runner, pre, reference, spec, x):
    store = FullKVStore(MemoryStore(), tiny_runner.layout, chunk_tokens=32)
    live = generate_vericache(tiny_runner, pre, parse_spec(spec), store, GenerationConfig(max_new_tokens=64, horizon=x))
    traj, misses = Trajectory.of(tiny_runner, pre, reference), []
    est = replay(tiny_runner, pre, traj, parse_spec(spec), x, misses=misses)
    assert est["committed"] == live.stats.committed
    assert est["lookup_accepted"] == live.stats.lookup_accepted
    if "trust=1" in spec:
        assert live.stats.lookup_drafted > 0
    else:  # model drafts only: every window that stopped short has its miss, where full KV chose otherwise
        short = [c for c, d in zip(est["committed"], est["horizons"], strict=True) if c - 1 < d]
        assert len(misses) == len(short) > 0
        for m in misses:
            logits = traj.logits[m.step]
            assert m.drafted != m.truth == traj.tokens[m.step] == int(logits.argmax())
            assert m.full_margin == pytest.approx(float(logits.max() - logits.topk(2).values[1]))
            assert m.full_margin >= 0 and m.draft_margin >= 0
