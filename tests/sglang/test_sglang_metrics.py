"""The plugin's metrics through SGLang's own multiprocess /metrics: a scheduler-side process records
real verdicts (the core's greedy acceptance), and SGLang's ``add_prometheus_middleware`` app, in
another process as its HTTP server would be, serves them, with exact counts. The live series of a
real server: ``tests/sglang/test_sglang_e2e.py``."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("sglang.srt.utils.common", reason="sglang is not installed (scripts/setup.sh installs it)")

SCHEDULER = r"""
import torch
from vericache_sglang.core.accept import greedy_accept
from vericache_sglang.sglang.step.acceptance import pack
from vericache_sglang.sglang.metrics import WorkerMetrics

m = WorkerMetrics({"model_name": "smollm2", "tp_rank": "0"})
drafts = torch.tensor([[5, 6, 7, 8], [1, 2, 3, 4]])
target = torch.tensor([[5, 6, 9, 0, 0], [1, 2, 3, 4, 11]])  # request 0 accepts 2, request 1 all 4
verdicts = [greedy_accept(d, t) for d, t in zip(drafts.tolist(), target.tolist())]
packed = pack(verdicts, 5, torch.tensor([10, 20]))
m.verified([v.accepted for v in packed.verdicts], [4, 4], 0.03)
m.full_kv_written.inc(4096)
m.compressed_kv.set(1000)
"""

SERVER = r"""
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sglang.srt.utils.common import add_prometheus_middleware

app = FastAPI()
add_prometheus_middleware(app)
print(TestClient(app).get("/metrics").text)
"""


def test_worker_metrics_reach_sglangs_metrics_endpoint(tmp_path):
    env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", SCHEDULER], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    done = subprocess.run([sys.executable, "-c", SERVER], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    text = done.stdout
    labels = 'model_name="smollm2",tp_rank="0"'
    assert f"vericache_verify_passes_total{{{labels}}} 2.0" in text
    assert f"vericache_generated_tokens_total{{{labels}}} 8.0" in text  # (2 + 1) + (4 + 1)
    assert f"vericache_drafted_tokens_total{{{labels}}} 8.0" in text
    assert f'vericache_accepted_length_bucket{{le="4.0",{labels}}} 1.0' in text
    assert f"vericache_full_kv_written_bytes_total{{{labels}}} 4096.0" in text
    assert "vericache_compressed_kv_bytes" in text and "1000.0" in text
