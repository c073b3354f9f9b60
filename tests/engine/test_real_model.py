"""SmolLM2-135M-Instruct, the CI representative set: one real 2,297-token prompt, 64 new tokens,
the full-KV reference computed once; every compressor at an aggressive setting."""

import json
import subprocess
import sys

import pytest

from vericache_sglang.bench.acceptance import Trajectory, replay
from vericache_sglang.core.compress import RECOMMENDED, parse_spec
from vericache_sglang.core.sampling import SamplingParams
from vericache_sglang.engine.engine import compare

pytestmark = pytest.mark.real_model

NEW_TOKENS = 64
# Lossy decoding diverging is what makes "identical" mean something: SnapKV shows it in the default
# set, the quantizer and the window in the heavy set (their exactness: tests/engine/test_real_family.py).
AGGRESSIVE = [
    "snapkv:ratio=0.125",
    pytest.param("kivi:bits=2", marks=pytest.mark.slow),
    pytest.param("streamingllm:window=256", marks=pytest.mark.slow),
]
SAMPLED = SamplingParams(temperature=0.8, seed=1234)


@pytest.fixture(scope="module")
def pre(prose_prefill):
    return prose_prefill


@pytest.fixture(scope="module")
def greedy_ref(real_engine, pre):
    return real_engine.generate(pre, "full", cfg=real_engine.config(max_new_tokens=NEW_TOKENS, keep_logits=True))


@pytest.fixture(scope="module")
def sampled_ref(real_engine, pre):
    cfg = real_engine.config(max_new_tokens=NEW_TOKENS, keep_logits=True, sampling=SAMPLED)
    return real_engine.generate(pre, "full", cfg=cfg)


@pytest.mark.parametrize("spec", AGGRESSIVE)
def test_greedy_identical_and_lossy_diverges(real_engine, pre, greedy_ref, spec, exactness):
    cfg = real_engine.config(max_new_tokens=NEW_TOKENS, keep_logits=True, horizon=16)
    res = real_engine.generate(pre, "vericache", spec, cfg)
    cmp = compare(greedy_ref, res)
    exactness(f"SmolLM2 prose greedy {spec}", cmp, accepted_length=res.stats.mean_accepted_length)
    assert cmp["identical"], cmp
    assert len(res.tokens) == len(greedy_ref.tokens)
    assert res.stats.compressed_kv_bytes < res.stats.full_kv_bytes / 3
    lossy = real_engine.generate(pre, "lossy", spec, cfg)
    assert not compare(greedy_ref, lossy)["identical"], f"lossy {spec} did not diverge in {NEW_TOKENS} tokens"


def test_seeded_sampling_identical(real_engine, pre, sampled_ref, exactness):
    cfg = real_engine.config(max_new_tokens=NEW_TOKENS, keep_logits=True, horizon=16, sampling=SAMPLED)
    res = real_engine.generate(pre, "vericache", "snapkv:ratio=0.125", cfg)
    cmp = compare(sampled_ref, res)
    exactness("SmolLM2 prose sampled T=0.8 snapkv:ratio=0.125", cmp)
    assert cmp["identical"], cmp


TRUSTED = "h2o:ratio=0.03125+refresh:ratio=0.09375,span=16+lookup:trust=4"  # trusted lookup (the heavy set)


@pytest.mark.parametrize("spec", [RECOMMENDED, pytest.param(TRUSTED, marks=pytest.mark.slow)])
def test_refresh_and_lookup_are_exact_and_draft_from_both_sources(
    real_engine, pre, greedy_ref, sampled_ref, spec, exactness
):
    """Issue #16's CI set: one refresh configuration with model-checked lookup (the recommended one)
    and one with trusted lookup (heavy set; on the tiny model in the default set); greedy and seeded
    sampling identical to full-KV decoding, lookup chains drafted and accepted, and the replay
    estimator equal to the live run."""
    cfg = real_engine.config(max_new_tokens=NEW_TOKENS, keep_logits=True, horizon=16)
    res = real_engine.generate(pre, "vericache", spec, cfg)
    cmp = compare(greedy_ref, res)
    exactness(f"SmolLM2 prose greedy {spec}", cmp, accepted_length=res.stats.mean_accepted_length)
    assert cmp["identical"], cmp
    assert res.stats.lookup_drafted > 0 and res.stats.lookup_accepted > 0
    assert res.stats.compressed_kv_bytes < res.stats.full_kv_bytes / 6
    est = replay(real_engine.runner, pre, Trajectory.of(real_engine.runner, pre, greedy_ref), parse_spec(spec), 16)
    assert est["committed"] == res.stats.committed
    sampled = real_engine.generate(
        pre,
        "vericache",
        spec,
        real_engine.config(max_new_tokens=NEW_TOKENS, keep_logits=True, horizon=16, sampling=SAMPLED),
    )
    cmp = compare(sampled_ref, sampled)
    exactness(f"SmolLM2 prose sampled T=0.8 {spec}", cmp)
    assert cmp["identical"], cmp


def test_stop_string_inside_a_window_cuts_where_full_kv_does(real_engine, pre, greedy_ref):
    text = greedy_ref.text
    stop = text[60:66]
    cfg = real_engine.config(max_new_tokens=NEW_TOKENS, horizon=16, stop_strings=(stop,))
    full = real_engine.generate(pre, "full", cfg=cfg)
    res = real_engine.generate(pre, "vericache", "snapkv:ratio=0.125", cfg)
    assert full.text == text[: text.index(stop)] == res.text
    assert res.tokens == full.tokens and res.finish_reason == "stop"


def vericache_cli(*args, timeout=600):
    return subprocess.run(
        [sys.executable, "-m", "vericache_sglang.cli", *args], capture_output=True, text=True, timeout=timeout
    )


def test_cli_json_check(tmp_path):
    from vericache_sglang.bench.sglang_server import document_prompt

    text = tmp_path / "prompt.txt"
    text.write_text(document_prompt("prose", 640))
    done = vericache_cli(
        "generate",
        "--prompt-file",
        str(text),
        "--max-new-tokens",
        "12",
        "--compressor",
        "kivi:bits=2",
        "--horizon",
        "8",
        "--check",
        "--json",
        "--threads",
        "2",
    )
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout)
    for key in (
        "identical",
        "generated_tokens",
        "mean_accepted_length",
        "verify_passes",
        "tokens_per_second",
        "full_kv_bytes",
        "compressed_kv_bytes",
        "max_logit_abs_diff",
        "text",
    ):
        assert key in out, key
    assert out["identical"] is True and out["generated_tokens"] == 12
    assert out["max_logit_abs_diff"] < 1e-3
    assert "prefill" in done.stderr  # progress goes to stderr


@pytest.mark.parametrize(
    "args,message",
    [
        (
            ["--compressor", "h2oo"],
            "unknown compressor 'h2oo' in spec 'h2oo'; choices: adakv, expected_attention, h2o,",
        ),
        (["--horizon", "0"], "horizon must be >= 1"),
        (["--model", "/nonexistent/model"], "no such directory"),
    ],
)
def test_cli_bad_input_is_a_clear_error(args, message):
    done = vericache_cli("generate", "--prompt", "hi", *args)
    assert done.returncode == 2 and message in done.stderr, done.stderr


def test_cli_prompt_longer_than_context(tmp_path):
    long = tmp_path / "long.txt"
    long.write_text("the quick brown fox " * 3000)
    done = vericache_cli("generate", "--prompt-file", str(long), "--quiet")
    assert done.returncode == 2 and "does not fit the model's context of 8192" in done.stderr, done.stderr


@pytest.mark.service
@pytest.mark.parametrize(
    "which",
    [
        pytest.param("redis_url", marks=pytest.mark.slow),
        "store_url",
        pytest.param("lmcache_url", marks=pytest.mark.slow),
    ],
)
def test_cli_store_backends_and_prefix_shared_across_processes(request, which, tmp_path):
    import uuid

    from vericache_sglang.bench.sglang_server import document_prompt

    url = request.getfixturevalue(which)
    text = tmp_path / "prompt.txt"
    text.write_text(document_prompt("prose", 640))  # ten store chunks: reuse needs no long prompt
    args = [
        "generate",
        "--prompt-file",
        str(text),
        "--max-new-tokens",
        "8",
        "--horizon",
        "4",
        "--store",
        url,
        "--store-namespace",
        uuid.uuid4().hex,
        "--check",
        "--json",
        "--threads",
        "2",
        "--quiet",
    ]
    first, second = vericache_cli(*args), vericache_cli(*args)
    assert first.returncode == 0 and second.returncode == 0, first.stderr[-2000:] + second.stderr[-2000:]
    a, b = json.loads(first.stdout), json.loads(second.stdout)
    assert a["identical"] and b["identical"]
    assert a["prefix_tokens_reused"] == 0
    assert b["prefix_tokens_reused"] == a["prompt_tokens"] // 64 * 64  # every whole prompt chunk
    assert a["fetch_bytes_per_verify"] > 0
