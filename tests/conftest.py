"""Shared fixtures: the tiny random Llama (fast), SmolLM2 (real_model), and an exactness report.

Every test that claims identical output records its max logit difference here; the session prints
them and writes ``.pytest-results/exactness.json``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

# Triton kernels run in the interpreter on a machine without a GPU; set before triton is imported.
if not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch

torch.set_num_threads(int(os.environ.get("VERICACHE_TEST_THREADS", "2")))

REPO = Path(__file__).resolve().parents[1]
PROMPTS = REPO / "benchmarks" / "prompts"
_EXACTNESS: list[dict] = []


@pytest.fixture(scope="session")
def tiny_runner():
    from vericache_sglang.engine.model import tiny_llama
    from vericache_sglang.engine.runner import ModelRunner

    return ModelRunner(tiny_llama())


@pytest.fixture(scope="session")
def real_engine():
    from vericache_sglang.engine.engine import Engine

    return Engine("smollm2")


@pytest.fixture(scope="session")
def prose_prefill(real_engine):
    """SmolLM2's exact prefill of the prose prompt, shared by the real-model exactness files."""
    tokens = real_engine.encode((PROMPTS / "prose.txt").read_text())
    assert len(tokens) >= 1500
    return real_engine.prefill(tokens, reuse_prefix=False)


@pytest.fixture
def exactness():
    """Record one identity check: ``exactness(name, comparison_dict)``."""

    def record(name: str, cmp: dict, **extra: object) -> None:
        _EXACTNESS.append({"check": name, **cmp, **extra})

    return record


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if not _EXACTNESS:
        return
    terminalreporter.section("exactness (VeriCache vs full-KV decoding)")
    for row in _EXACTNESS:
        diff, what = row.get("max_logit_abs_diff"), "dlogit"
        if diff is None and row.get("max_logprob_abs_diff") is not None:  # a server returns logprobs only
            diff, what = row["max_logprob_abs_diff"], "dlogprob"
        terminalreporter.write_line(
            f"{row['check']:<60} identical={row['identical']} tokens={row['compared_tokens']} "
            f"max|{what}|={'-' if diff is None else f'{diff:.2e}'}"
        )
    out = REPO / ".pytest-results"
    out.mkdir(exist_ok=True)
    (out / "exactness.json").write_text(json.dumps(_EXACTNESS, indent=2, default=str))


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory):
    """A real Redis: CI's (VERICACHE_TEST_REDIS_URL) or one started for this session."""
    from services import RedisServer, env_url, redis_available

    url = env_url("VERICACHE_TEST_REDIS_URL")
    if url:
        yield url
        return
    if not redis_available():
        pytest.skip("redis-server is not installed (CI installs it; see .ci/run)")
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    yield server.url
    server.stop()


@pytest.fixture(scope="session")
def redis_cluster_url(tmp_path_factory):
    """A real Redis Cluster of three primaries, started for this session (``services.RedisCluster``)."""
    from services import RedisCluster, redis_available

    if not redis_available():
        pytest.skip("redis-server is not installed (CI installs it; see .ci/run)")
    cluster = RedisCluster(tmp_path_factory.mktemp("redis-cluster"))
    yield cluster.url
    cluster.stop()


@pytest.fixture(scope="session")
def store_url(tmp_path_factory):
    """Our gRPC store server: CI's (VERICACHE_TEST_STORE_URL) or one started for this session."""
    from services import StoreServer, env_url

    url = env_url("VERICACHE_TEST_STORE_URL")
    if url:
        yield url
        return
    server = StoreServer(tmp_path_factory.mktemp("store"))
    yield server.url
    server.stop()


@pytest.fixture(scope="session")
def lmcache_url(tmp_path_factory, redis_url):
    """The LMCache sidecar (its own environment, .venv-lmcache): CI's or one started here."""
    from services import LMCacheSidecar, env_url, lmcache_available

    url = env_url("VERICACHE_TEST_LMCACHE_URL")
    if url:
        yield url
        return
    if not lmcache_available():
        pytest.skip("the LMCache environment is not set up (scripts/setup_lmcache.sh; CI does it)")
    sidecar = LMCacheSidecar(tmp_path_factory.mktemp("lmcache"), redis_url.split("/0")[0])
    yield sidecar.url
    sidecar.stop()


@pytest.fixture(params=["memory", "redis", "redis-cluster", "grpc", "lmcache"])
def backend_url(request):
    """Each backend in turn, as a store URL."""
    if request.param == "memory":
        return "memory://"
    fixture = {
        "redis": "redis_url",
        "redis-cluster": "redis_cluster_url",
        "grpc": "store_url",
        "lmcache": "lmcache_url",
    }
    return request.getfixturevalue(fixture[request.param])


# on every SGLang server of the tests, stock and VeriCache alike: SGLang's own tool-call parsing
SGLANG_TEST_FLAGS = ("--tool-call-parser", "qwen25")


@pytest.fixture(scope="session")
def sglang_logs(tmp_path_factory):
    """Where the SGLang server processes of the session write their logs."""
    return tmp_path_factory.mktemp("sglang")


def _session_uses(session: pytest.Session, fixture: str) -> bool:
    return any(fixture in getattr(item, "fixturenames", ()) for item in session.items)


@pytest.fixture(scope="session")
def vericache_launch(sglang_logs):
    """The session's one ``--enable-vericache`` server (``sglang_e2e.MODIFIERS``: SnapKV with both
    drafting modifiers; the full KV on the device, where the radix tree caches prompts, so a shared
    document is cached), launched beside stock without waiting for it: its user waits
    (``wait_healthy``) and stops it when done. The full KV off the device, in the store or the host
    pool: ``tests/sglang/test_sglang_e2e_modes.py``."""
    pytest.importorskip("sglang.srt.entrypoints.http_server", reason="sglang is not installed")
    from sglang_e2e import MODIFIERS

    from vericache_sglang.bench.sglang_server import SGLangServer

    server = SGLangServer(sglang_logs, "vericache", *SGLANG_TEST_FLAGS, vericache=MODIFIERS, wait=False)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def store_mode_launch(sglang_logs, store_url):
    """The default set's ``full_kv: "store"`` server (``sglang_e2e.store_mode_config``), launched
    beside stock without waiting for it; its user waits and stops it."""
    pytest.importorskip("sglang.srt.entrypoints.http_server", reason="sglang is not installed")
    from sglang_e2e import store_mode_config

    from vericache_sglang.bench.sglang_server import SGLangServer

    server = SGLangServer(sglang_logs, "snapkv-store-grpc", vericache=store_mode_config(store_url), wait=False)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def stock_server(request, sglang_logs):
    """Stock SGLang 0.5.23 on this CPU (no plugin flag): the reference every VeriCache server is held to.

    It schedules as a VeriCache server does, without overlap (``--enable-vericache`` implies
    ``--disable-overlap-schedule``, as every speculative algorithm without overlap support): with
    overlap, SGLang applies frequency/presence penalties one token late (its decode preparation
    reads a request's output before the previous step's token lands), so a penalised request's
    text depends on the scheduling mode, not on the KV."""
    pytest.importorskip("sglang.srt.entrypoints.http_server", reason="sglang is not installed")
    from vericache_sglang.bench.sglang_server import SGLangServer

    for launch in ("vericache_launch", "store_mode_launch"):  # loaded beside stock: the starts overlap
        if _session_uses(request.session, launch):
            request.getfixturevalue(launch)
    server = SGLangServer(sglang_logs, "stock", *SGLANG_TEST_FLAGS, "--disable-overlap-schedule")
    yield server
    server.stop()
