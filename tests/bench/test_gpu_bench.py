"""benchmarks/gpu_bench.sh: checked here on CPU for its arguments (default set) and every section on
tiny shapes (heavy set); the GPU run itself happens only on a lent GPU machine (skipped without
CUDA)."""

import json
import os
import subprocess

import pytest
import torch
from conftest import REPO

SCRIPT = str(REPO / "benchmarks" / "gpu_bench.sh")


def run(*args, timeout=600):
    env = {**os.environ, "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET", "1")}
    return subprocess.run([SCRIPT, *args], capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.slow
@pytest.mark.bench
def test_quick_cpu_run_writes_every_section(tmp_path):
    # the time box is the GPU session's budget; on CPU it must not make the check depend on machine speed
    done = run("--device", "cpu", "--quick", "--minutes", "30", "--out", str(tmp_path), timeout=1800)
    assert done.returncode == 0, done.stdout + done.stderr
    out = json.loads((tmp_path / "gpu_bench.json").read_text())
    assert out["errors"] == {}
    assert out["bandwidth"]["memory_bytes_s"] > 0
    assert out["decode"]["rows"] and out["kernels"]["equal_to_reference"] is True
    checks = out["compressors"]["rows"]
    assert {r["compressor"] for r in checks} >= {"h2o", "quest", "kvquant", "snapkv:ratio=0.25+kivi:bits=4"}
    assert all(r.get("identical") for r in checks), [r for r in checks if not r.get("identical")]
    assert (tmp_path / "gpu_bench.md").read_text().startswith("# gpu_bench on cpu")


def test_bad_arguments(tmp_path):
    assert run("--minutes", "0").returncode == 2
    assert run("--shape", "gpt-5").returncode == 2
    assert run("--device", "cpu", "--quick", "--sections", "decode,nope").returncode == 2
    assert run("--device", "cpu", "--quick", "--variants", "fp64").returncode == 2
    if not torch.cuda.is_available():
        done = run("--out", str(tmp_path))
        assert done.returncode == 2 and "no CUDA device" in done.stderr


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_run(tmp_path):
    done = run("--minutes", "4", "--out", str(tmp_path), timeout=360)
    assert done.returncode == 0, done.stdout + done.stderr
