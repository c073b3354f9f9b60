"""The reference engine on a tiny random Llama: fast checks of the loop's every path."""

import dataclasses

import pytest
import torch
from faults import HookedStore, failing_from

from remote_store.backends.memory import MemoryStore
from remote_store.link import LinkEmulator
from vericache_sglang.core.compress import COMPRESSORS as REGISTRY
from vericache_sglang.core.compress import parse_spec
from vericache_sglang.core.sampling import SamplingParams
from vericache_sglang.engine.decode import GenerationConfig, generate_full, generate_lossy, generate_vericache
from vericache_sglang.engine.engine import compare
from vericache_sglang.engine.fetch import FetchError
from vericache_sglang.engine.model import ModelError, load_model, model_layout
from vericache_sglang.engine.prefill import prefill
from vericache_sglang.engine.runner import ModelRunner, ResidentKV, Segment
from vericache_sglang.full_kv.store import FullKVStore

COMPRESSORS = [
    "snapkv:ratio=0.25,window=16",
    "kivi:bits=2,group=16,residual=32",
    "streamingllm:sink=4,window=32",
    # verification-guided refresh; prompt lookup composed (trusted, and model-checked only)
    "snapkv:ratio=0.125,window=16+refresh:ratio=0.125",
    "streamingllm:sink=4,window=32+lookup:trust=2",
    "h2o:ratio=0.125+refresh:ratio=0.0625+lookup:trust=0",
]
SAMPLED = SamplingParams(temperature=0.8, top_k=50, top_p=0.95, seed=7)


@pytest.fixture(scope="module")
def prompt():
    return torch.randint(0, 512, (300,), generator=torch.Generator().manual_seed(3)).tolist()


@pytest.fixture(scope="module")
def pre(tiny_runner, prompt):
    return prefill(tiny_runner, prompt, chunk=128)


def store_for(runner, backend=None, chunk_tokens=32):
    return FullKVStore(backend or MemoryStore(), runner.layout, chunk_tokens=chunk_tokens)


def cfg(**kw):
    kw.setdefault("max_new_tokens", 48)
    kw.setdefault("keep_logits", True)
    return GenerationConfig(**kw)


@pytest.fixture(scope="module")
def reference(tiny_runner, pre):
    return generate_full(tiny_runner, pre, cfg())


@pytest.fixture(scope="module")
def sampled_reference(tiny_runner, pre):
    return generate_full(tiny_runner, pre, cfg(sampling=SAMPLED))


def test_runner_matches_transformers(tiny_runner, prompt):
    with torch.inference_mode():
        ref = tiny_runner.model(torch.tensor([prompt])).logits[0]
    ctx = ResidentKV(tiny_runner.layout, 300)
    out = tiny_runner.forward([Segment(prompt[:250], list(range(250)), ctx)])[0]
    assert (out.logits - ref[:250]).abs().max() < 1e-4
    for i in range(250, 300):
        step = tiny_runner.forward([Segment([prompt[i]], [i], ctx, logits="last")])[0]
        assert (step.logits[0] - ref[i]).abs().max() < 1e-4


def test_batched_forward_equals_single(tiny_runner, prompt):
    a, b = ResidentKV(tiny_runner.layout, 64), ResidentKV(tiny_runner.layout, 64)
    single = tiny_runner.forward([Segment(prompt[:20], list(range(20)), a)])[0]
    both = tiny_runner.forward(
        [
            Segment(prompt[:20], list(range(20)), b),
            Segment(prompt[30:37], list(range(7)), ResidentKV(tiny_runner.layout, 8)),
        ]
    )
    assert (both[0].logits - single.logits).abs().max() < 1e-5
    assert both[1].logits.shape == (7, 512)


@pytest.mark.parametrize("spec", COMPRESSORS)
def test_vericache_greedy_identical(tiny_runner, pre, reference, spec, exactness):
    res = generate_vericache(tiny_runner, pre, parse_spec(spec), store_for(tiny_runner), cfg(horizon=8))
    cmp = compare(reference, res)
    exactness(f"tiny greedy {spec}", cmp)
    assert cmp["identical"], cmp
    assert res.stats.verify_passes == len(res.stats.committed)
    assert sum(res.stats.committed) == len(res.tokens) - 1  # the first token comes from the prefill


@pytest.mark.parametrize("spec", COMPRESSORS)
def test_vericache_seeded_sampling_identical(tiny_runner, pre, sampled_reference, spec, exactness):
    res = generate_vericache(
        tiny_runner, pre, parse_spec(spec), store_for(tiny_runner), cfg(horizon=8, sampling=SAMPLED)
    )
    cmp = compare(sampled_reference, res)
    exactness(f"tiny sampled T=0.8 {spec}", cmp)
    assert cmp["identical"], cmp


# Every registered compressor at its defaults (quantizers' channel groups cut to the tiny model's
# head dim of 16); on SmolLM2 the default set runs one of each family (tests/engine/test_real_family.py)
# and the heavy set all of them. KVzip reconstructs the prompt through the tokenizer, which the tiny
# model has not: it runs on SmolLM2 only.
@pytest.mark.parametrize("name", sorted(set(REGISTRY) - {"kvzip"}))
def test_every_compressor_at_its_defaults_is_identical(tiny_runner, pre, reference, name, exactness):
    has_group = "group" in {f.name for f in dataclasses.fields(REGISTRY[name].Params)}
    spec = f"{name}:group=16" if has_group else name
    res = generate_vericache(tiny_runner, pre, parse_spec(spec), store_for(tiny_runner), cfg(horizon=8))
    cmp = compare(reference, res)
    exactness(f"tiny greedy {spec} (defaults)", cmp)
    assert cmp["identical"], cmp


def test_sampled_output_depends_on_seed(tiny_runner, pre, sampled_reference):
    other = generate_full(tiny_runner, pre, cfg(sampling=SamplingParams(temperature=0.8, top_k=50, top_p=0.95, seed=8)))
    assert other.tokens != sampled_reference.tokens


def test_rejection_sampling_commits_only_verified_tokens(tiny_runner, pre):
    res = generate_vericache(
        tiny_runner,
        pre,
        parse_spec(COMPRESSORS[0]),
        store_for(tiny_runner),
        cfg(horizon=8, sampling=SAMPLED, verify="rejection"),
    )
    assert len(res.tokens) == 48
    assert sum(res.stats.committed) == 47 and all(c >= 1 for c in res.stats.committed)


def test_lossy_runs_and_differs(tiny_runner, pre, reference):
    res = generate_lossy(tiny_runner, pre, parse_spec("snapkv:ratio=0.1,window=8"), cfg())
    assert len(res.tokens) == 48 and res.tokens != reference.tokens
    kept = 30 + 47  # ceil(0.1 * 300) prompt tokens, then every decoded token but the last
    per_token = 2 * 16 * 4 + 4  # K and V of one head in float32, plus its int32 position
    assert res.stats.compressed_kv_bytes == 4 * 2 * kept * per_token


def test_eos_inside_a_draft_window_stops_where_full_kv_does(tiny_runner, pre, reference):
    eos = reference.tokens[17]
    first = reference.tokens.index(eos)
    c = cfg(horizon=16, eos_token_ids=(eos,))
    full = generate_full(tiny_runner, pre, c)
    res = generate_vericache(tiny_runner, pre, parse_spec(COMPRESSORS[0]), store_for(tiny_runner), c)
    assert full.tokens == reference.tokens[: first + 1] == res.tokens
    assert res.finish_reason == full.finish_reason == "stop"


def test_max_new_tokens_cut_inside_a_window(tiny_runner, pre, reference):
    res = generate_vericache(
        tiny_runner, pre, parse_spec(COMPRESSORS[1]), store_for(tiny_runner), cfg(horizon=16, max_new_tokens=37)
    )
    assert res.tokens == reference.tokens[:37] and res.finish_reason == "length"


def test_logprobs_come_from_the_verifier(tiny_runner, pre):
    c = cfg(max_new_tokens=24, logprobs=True, horizon=6)
    full = generate_full(tiny_runner, pre, c)
    res = generate_vericache(tiny_runner, pre, parse_spec(COMPRESSORS[0]), store_for(tiny_runner), c)
    assert res.tokens == full.tokens
    assert max(abs(a - b) for a, b in zip(full.logprobs, res.logprobs, strict=True)) < 1e-4
    lossy = generate_lossy(tiny_runner, pre, parse_spec("snapkv:ratio=0.1,window=8"), c)
    # the drafter's own (lossy) logprobs are not what is reported
    assert max(abs(a - b) for a, b in zip(full.logprobs, lossy.logprobs, strict=False)) > 1e-3


def test_verify_computes_layer0_before_the_last_layer_arrives(tiny_runner, pre, reference):
    # Each layer's read takes 0.25 s on this link, far longer than drafting 4 tokens on the tiny
    # model even on a loaded machine, so the verify pass must wait for layers as they arrive.
    link = LinkEmulator(MemoryStore(), bandwidth_bytes_s=2e9, latency_s=0.25)
    timings = []
    res = generate_vericache(
        tiny_runner,
        pre,
        parse_spec(COMPRESSORS[0]),
        store_for(tiny_runner, link),
        cfg(horizon=4, max_new_tokens=8),
        timings=timings,
    )
    assert res.tokens == reference.tokens[:8]
    assert timings
    for t in timings:
        assert t.layer_compute[0] < t.layer_arrival[-1], t  # layer 0 computed while later layers were in flight
        assert all(c >= a for c, a in zip(t.layer_compute, t.layer_arrival, strict=True))  # none before its KV


def test_store_failure_mid_fetch_fails_cleanly(tiny_runner, pre, reference):
    emitted = []
    backend = HookedStore(MemoryStore(), failing_from(2 * tiny_runner.layout.num_layers + 2))
    with pytest.raises(FetchError, match="no unverified token"):
        generate_vericache(
            tiny_runner,
            pre,
            parse_spec(COMPRESSORS[0]),
            store_for(tiny_runner, backend),
            cfg(horizon=8, on_store_error="fail"),
            on_commit=emitted.extend,
        )
    assert backend.gets >= 2 * 4 + 2
    assert 1 < len(emitted) < 48
    assert emitted == reference.tokens[: len(emitted)]  # everything emitted was verified


def test_store_failure_mid_fetch_falls_back_to_recompute(tiny_runner, pre, reference, exactness):
    backend = HookedStore(MemoryStore(), failing_from(2 * tiny_runner.layout.num_layers + 2))
    res = generate_vericache(
        tiny_runner, pre, parse_spec(COMPRESSORS[0]), store_for(tiny_runner, backend), cfg(horizon=8)
    )
    cmp = compare(reference, res)
    exactness("tiny greedy, store fails mid-fetch, recompute", cmp)
    assert cmp["identical"] and res.stats.store_fallbacks == 1


def test_bad_inputs(tiny_runner, tmp_path):
    with pytest.raises(ValueError, match="horizon"):
        GenerationConfig(horizon=0)
    with pytest.raises(ValueError, match="horizon"):
        GenerationConfig(horizon=-3)
    with pytest.raises(ValueError, match="does not fit the model's context"):
        prefill(tiny_runner, [1] * 2048)
    with pytest.raises(ValueError, match="empty prompt"):
        prefill(tiny_runner, [])
    with pytest.raises(ModelError, match="no such directory"):
        load_model(str(tmp_path / "nope"))
    (tmp_path / "m").mkdir()
    with pytest.raises(ModelError, match=r"config\.json"):
        load_model(str(tmp_path / "m"))
    (tmp_path / "m" / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(ModelError, match="no weight files"):
        load_model(str(tmp_path / "m"))
    with pytest.raises(ModelError, match="no weight files"):
        model_layout(str(tmp_path / "m"))
    assert model_layout("tiny") == tiny_runner.layout


def test_generation_near_the_context_end_stops(tiny_runner):
    pre = prefill(tiny_runner, [5] * 2030)
    res = generate_vericache(
        tiny_runner, pre, parse_spec(COMPRESSORS[2]), store_for(tiny_runner), cfg(max_new_tokens=40, horizon=8)
    )
    assert len(pre.tokens) + len(res.tokens) <= 2048


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
def test_local_hf_directories_of_each_family_load_and_match_transformers(tmp_path, family):
    """--model PATH: a local HF-format directory (here a small random model of each family, saved
    with save_pretrained) loads with its tokenizer-less config and the runner matches transformers."""
    import transformers

    cls = {
        "llama": ("LlamaConfig", "LlamaForCausalLM"),
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
        "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
        "mistral": ("MistralConfig", "MistralForCausalLM"),
    }[family]
    config = getattr(transformers, cls[0])(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        head_dim=16,
        sliding_window=None,
    )
    torch.manual_seed(0)
    getattr(transformers, cls[1])(config).save_pretrained(tmp_path)
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]")), unk_token="[UNK]"
    ).save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path))
    runner = ModelRunner(loaded)
    tokens = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.inference_mode():
        ref = loaded.model(torch.tensor([tokens])).logits[0]
    out = runner.forward([Segment(tokens, list(range(40)), ResidentKV(runner.layout, 40))])[0]
    assert (out.logits - ref).abs().max() < 1e-4
    assert loaded.model_id.startswith(tmp_path.name + "@")
    # the layout store keys are named by, read without the weights (`vericache prefix list --store`)
    assert model_layout(str(tmp_path)) == runner.layout


def test_batch_invariant_runner_is_exact_and_row_stable(tiny_runner, pre, reference, exactness):
    """The GPU mode (64-row buckets, one-query attention per row) on CPU: the same tokens, and a
    verify pass's rows equal to one-token decode steps bit for bit."""
    inv = ModelRunner(tiny_runner.loaded, row_bucket=64, row_attention=True)
    res = generate_vericache(inv, pre, parse_spec(COMPRESSORS[0]), store_for(inv), cfg(horizon=8))
    cmp = compare(reference, res)
    exactness("tiny greedy batch-invariant runner", cmp)
    assert cmp["identical"], cmp
    tokens = reference.tokens[:9]
    n = len(pre.tokens)
    many = inv.forward([Segment(tokens, list(range(n, n + 9)), ResidentKV.from_full(pre.kv, n + 9))])[0]
    ctx = ResidentKV.from_full(pre.kv, n + 9)
    for i, t in enumerate(tokens):
        one = inv.forward([Segment([t], [n + i], ctx, logits="last")])[0]
        assert torch.equal(one.logits[0], many.logits[i])
    with pytest.raises(ValueError, match="row_bucket"):
        ModelRunner(tiny_runner.loaded, row_bucket=-1)


def test_adaptive_horizon_is_exact_and_follows_costs(tiny_runner, pre, reference, exactness):
    res = generate_vericache(
        tiny_runner,
        pre,
        parse_spec("kivi:bits=4,group=16,residual=32"),
        store_for(tiny_runner),
        cfg(horizon=64, adaptive_horizon=True),
    )
    cmp = compare(reference, res)
    exactness("tiny greedy adaptive horizon", cmp)
    assert cmp["identical"], cmp
    assert res.stats.drafted[0] == 16 and len(set(res.stats.drafted)) > 1  # it adapts after the first window
