"""The benchmark scripts' quick runs on SmolLM2 (the heavy set, ``-m bench``): every VeriCache
output identical to full-KV decoding, and the summary keys the README and the issues name. The
default set keeps the checks that refuse a bad configuration before the model loads; the batch
engine's exactness in every mode is ``tests/engine/test_batch.py``, the remote prefixes'
``tests/serve/test_serve_prefix.py``."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.real_model

MODES = ("full_resident", "full_offloaded", "lossy", "vericache_lockstep", "vericache_staggered")


def bench(which, tmp_path, config: str | None = None):
    extra = ["--config", str(REPO / "benchmarks" / "configs" / config)] if config else []
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "vericache_sglang.cli",
            "bench",
            which,
            "--quick",
            "--json",
            "--out",
            str(tmp_path),
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return json.loads(done.stdout)


@pytest.mark.slow
@pytest.mark.bench
def test_longctx_quick(tmp_path):
    out = bench("longctx", tmp_path)
    assert out["identical"] is True
    assert set(out["throughput_tok_s"]) == set(MODES) and all(v > 0 for v in out["throughput_tok_s"].values())
    assert 0.0 <= out["hidden_transfer_fraction"] <= 1.0
    for name in ("longctx_quick.json", "longctx_quick.md", "longctx_quick_budget.png", "longctx_quick_link.png"):
        assert (tmp_path / name).is_file()
    rows = json.loads((tmp_path / "longctx_quick.json").read_text())["rows"]
    for r in rows:
        assert r["rows"] > 0 and r["ms_per_iteration"] > 0 and r["gflop_s"] > 0
        if r["mode"].startswith("vericache"):
            # every committed token but the prefill's took a verify row, and drafts came before them;
            # the verify rows read the whole full KV, so a token costs more arithmetic than resident's
            assert r["rows_per_token"] > 1 and r["compute_bound_tok_s"] > 0
            assert r["gflop_per_token"] > next(p["gflop_per_token"] for p in rows if p["mode"] == "full_resident")
            # the emulated link moved every fetched byte at its bandwidth: nothing beats that ceiling
            assert r["throughput_tok_s"] <= r["link_bound_tok_s"]


@pytest.mark.slow
@pytest.mark.bench
def test_prefix_quick(tmp_path):
    out = bench("prefix", tmp_path)
    assert out["identical"] is True
    assert set(out["ttft_s"]) == set(out["throughput_tok_s"]) == {"fetch_then_decode", "vericache"}
    assert (tmp_path / "prefix_quick.png").is_file()


@pytest.mark.slow
@pytest.mark.bench
def test_compressors_side_by_side_quick(tmp_path):
    """The re-runs of issue #16 (longctx_drafting.json, prefix_drafting.json): several compressors
    in one run, drafting modifiers included, every output identical."""
    out = bench("longctx", tmp_path, "longctx_drafting.json")
    assert out["identical"] is True and out["compressor"] == "streamingllm:sink=4,window=512"
    rows = json.loads((tmp_path / "longctx_drafting_quick.json").read_text())["rows"]
    specs = {r["compressor"] for r in rows if r["mode"] == "vericache_staggered"}
    assert len(specs) == 2 and any("+refresh" in s for s in specs) and all(r["identical"] for r in rows)
    out = bench("prefix", tmp_path, "prefix_drafting.json")
    assert out["identical"] is True and len(out["by_compressor"]) == 2
    assert "| compressor |" in (tmp_path / "prefix_drafting_quick.md").read_text()


@pytest.mark.slow
@pytest.mark.bench
def test_drafting_quick(tmp_path):
    """benchmarks/drafting.py --quick: every table written, the replay equal to the live run it
    is checked against, the RAG peers identical to full-KV decoding."""
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "drafting.py"), "--quick", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    out = json.loads((tmp_path / "drafting.json").read_text())
    assert out["grid"] and out["peers"] and out["long"]
    assert out["rag"] and all(r["identical"] for r in out["rag"])
    for check in out["live_checks"]:
        assert check["identical"] is True
        assert check["live_mean_accepted_length"] == pytest.approx(check["estimated_mean_accepted_length"], abs=0.25)
    assert (tmp_path / "drafting.png").is_file() and "RAG setting" in (tmp_path / "drafting.md").read_text()


@pytest.mark.slow
@pytest.mark.bench
def test_acceptance_quick(tmp_path):
    """benchmarks/acceptance.py --quick: the estimator agrees with the live run it is checked
    against, and the table, plots and KL curves are written."""
    from conftest import REPO

    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "acceptance.py"), "--quick", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    out = json.loads((tmp_path / "acceptance.json").read_text())
    assert out["grid"] and all(r["mean_accepted_length"] >= 1.0 for r in out["grid"])
    for check in out["live_checks"]:
        assert check["live_identical"] is True
        # The estimator drafts a window in one forward, the engine step by step: float rounding
        # differs, so a near-tie could flip one window; measured equal so far.
        assert check["live_mean_accepted_length"] == pytest.approx(check["estimated_mean_accepted_length"], abs=0.25)
    assert all(curve[0] == 0.0 and len(curve) == out["config"]["new_tokens"] for curve in out["kl"].values())
    assert out["adaptive"] and all(a["adaptive"] > 0 for a in out["adaptive"])
    for name in (
        "acceptance.md",
        "acceptance_mean_accepted_length_vs_horizon.png",
        "acceptance_vs_ratio.png",
        "acceptance_kl_vs_step.png",
    ):
        assert (tmp_path / name).is_file()


@pytest.mark.slow
@pytest.mark.bench
def test_step_cost_quick(tmp_path):
    """vericache bench steps --quick (tiny model): every iteration kind timed against its bytes at
    the probe's bandwidth, the probe's spread reported, the profile written."""
    out = bench("steps", tmp_path)
    probe = out["memory_probe"]
    assert probe["low_bytes_s"] <= probe["bytes_s"] <= probe["high_bytes_s"] and probe["reads"] >= 5
    iterations = {"full decode", "draft snapkv:ratio=0.125", "draft kivi:bits=2,group=16"}
    assert set(out["over_bytes_at_check"]) == iterations | {"weights pass"}
    assert set(out["kv_over_bytes_at_check"]) == iterations
    assert all(v > 0 for v in out["over_bytes_at_check"].values())
    data = json.loads((tmp_path / "step_cost_quick.json").read_text())
    kinds = {r["kind"] for r in data["rows"]}
    assert kinds == {"weights", "full", "draft", "verify"}
    assert all(r["ms"] > 0 and r["byte_ms"] > 0 for r in data["rows"])
    # a step beyond the weights' pass is set against its KV's own bytes
    assert all("kv_over_bytes" in r for r in data["rows"] if r["kind"] != "weights")
    assert set(data["profiles"]) == {r["iteration"] for r in data["rows"] if (r["context"], r["batch"]) == (256, 3)}
    assert (tmp_path / "step_cost_quick.md").is_file() and (tmp_path / "step_cost_quick.png").is_file()


def test_longctx_modes_are_checked_before_anything_runs(tmp_path):
    """The demo's batch phase runs a subset of longctx's modes; a subset without the reference
    first, or without staggered VeriCache, is refused before the model loads."""
    from vericache_sglang.bench import longctx

    base = json.loads((REPO / "benchmarks/configs/demo_batch.json").read_text())
    assert base["modes"][0] == "full_resident" and "vericache_staggered" in base["modes"]
    for modes in (["vericache_staggered", "full_resident"], ["full_resident", "lossy"], ["full_resident", "nope"], []):
        path = tmp_path / "c.json"
        path.write_text(json.dumps({**base, "modes": modes}))
        with pytest.raises(ValueError, match="full_resident first"):
            longctx.run(path)


@pytest.mark.parametrize("which", ["longctx", "prefix"])
def test_a_compressors_list_must_open_with_the_summarys_compressor(tmp_path, which):
    """Side-by-side runs summarise their first compressor: a list that does not open with the
    config's ``compressor`` is refused before the model loads."""
    import importlib

    module = importlib.import_module(f"vericache_sglang.bench.{which}")
    base = json.loads((REPO / f"benchmarks/configs/{which}_drafting.json").read_text())
    path = tmp_path / "c.json"
    path.write_text(json.dumps({**base, "compressors": base["compressors"][::-1]}))
    with pytest.raises(ValueError, match="the first is the summary's"):
        module.run(path)
