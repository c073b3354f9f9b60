"""A full-KV store that cannot be used as configured fails what starts on it, at once, naming the URL
(without its secret) and the cause: a wrong or missing token, a TLS mismatch, an address that does
not answer, an unknown scheme. For ``vericache generate``, ``serve``, ``prefix add`` and SGLang's
launcher with the plugin. A store that refuses credentials mid-run fails the request (never
silently recomputed); an outage still falls back (tests/store/test_store_faults.py)."""

from __future__ import annotations

import concurrent.futures as cf
import json
import subprocess
import sys
import uuid

import pytest
from faults import HookedStore
from services import RedisServer, StoreServer, free_port, redis_available

from remote_store import StoreConfigError, connect_store, refused

REPO = __import__("conftest").REPO


@pytest.fixture(scope="module")
def token_store(tmp_path_factory):
    server = StoreServer(tmp_path_factory.mktemp("store"), token="s3cret")
    yield server
    server.stop()


def _bad_urls(port: int) -> dict[str, tuple[str, str]]:
    """name -> (URL, what the error says)."""
    return {
        "wrong token": (f"grpc://:wrong@127.0.0.1:{port}", "refused this client's credentials"),
        "missing token": (f"grpc://127.0.0.1:{port}", "refused this client's credentials"),
        "TLS mismatch": (f"grpcs://:s3cret@127.0.0.1:{port}", "the TLS settings do not match"),
        "unreachable": (f"grpc://:s3cret@127.0.0.1:{free_port()}", "it does not answer"),
    }


def test_connect_store_names_the_url_without_its_secret_and_the_cause(token_store):
    assert connect_store(token_store.url).exists_many(["nothing"]) == [False]
    for name, (url, cause) in _bad_urls(token_store.port).items():
        with pytest.raises(StoreConfigError) as e:
            connect_store(url)
        message = str(e.value)
        assert cause in message and f"127.0.0.1:{url.rsplit(':', 1)[1]}" in message, (name, message)
        assert "wrong" not in message.split("failed at")[0] and "s3cret" not in message, (name, message)
    with pytest.raises(StoreConfigError, match="unknown store URL 'bogus://x'"):
        connect_store("bogus://x")


@pytest.mark.skipif(not redis_available(), reason="redis-server is not installed")
def test_redis_with_a_password_refuses_wrong_and_missing_ones(tmp_path):
    server = RedisServer(tmp_path, password="pw1")
    try:
        assert connect_store(server.url).exists_many(["k"]) == [False]
        for url in (f"redis://:nope@127.0.0.1:{server.port}/0", f"redis://127.0.0.1:{server.port}/0"):
            with pytest.raises(StoreConfigError, match="refused this client's credentials") as e:
                connect_store(url)
            assert "nope" not in str(e.value)
    finally:
        server.stop()


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "vericache_sglang.cli", *args], cwd=REPO, capture_output=True, text=True, timeout=300
    )


# Every cause is checked where the store is opened (connect_store, above); each command is checked
# with one of them in the default set and with all of them in the heavy set.
DEFAULT_CAUSE = "wrong token"
CAUSES = [
    pytest.param(name, id=name.replace(" ", "-"), marks=() if name == DEFAULT_CAUSE else pytest.mark.slow)
    for name in _bad_urls(0)
]


@pytest.mark.real_model
@pytest.mark.parametrize("case", CAUSES)
def test_generate_serve_and_prefix_exit_non_zero_at_start(token_store, tmp_path, case):
    doc = tmp_path / "doc.txt"
    doc.write_text("A short document. " * 40)
    url, cause = _bad_urls(token_store.port)[case]
    with cf.ThreadPoolExecutor(3) as pool:
        runs = {
            "generate": pool.submit(_cli, "generate", "--prompt", "hi", "--max-new-tokens", "4", "--store", url),
            "serve": pool.submit(_cli, "serve", "--port", str(free_port()), "--store", url),
            "prefix add": pool.submit(_cli, "prefix", "add", str(doc), "--store", url),
        }
    for command, future in runs.items():
        done = future.result()
        assert done.returncode != 0, (command, case, done.stdout[-500:])
        assert "vericache: error: store grpc" in done.stderr and cause in done.stderr, (
            command,
            case,
            done.stderr[-1500:],
        )


@pytest.mark.sglang
@pytest.mark.parametrize("case", CAUSES)
def test_sglangs_launch_fails_fast_on_a_store_it_cannot_use(token_store, case):
    from vericache_sglang.bench.sglang_server import cpu_env, launch_command

    def launch(url: str) -> subprocess.CompletedProcess:
        config = json.dumps({"compressor": "snapkv:ratio=0.125", "full_kv": "store", "store": url})
        return subprocess.run(
            launch_command(
                free_port(), "--max-total-tokens", "4096", "--enable-vericache", "--vericache-config", config
            ),
            cwd=REPO,
            env=cpu_env(),
            capture_output=True,
            text=True,
            timeout=400,
            start_new_session=True,
        )

    url, cause = _bad_urls(token_store.port)[case]
    done = launch(url)
    out = done.stdout + done.stderr
    assert done.returncode != 0, case
    assert "StoreConfigError" in out and cause in out, (case, out[-3000:])


def test_a_store_that_starts_refusing_mid_run_fails_the_request_without_recomputing(tiny_runner, token_store):
    """The store's token is rotated while a request runs (its server restarted with another): the
    next fetch is refused, and the request ends with that error; nothing is recomputed around it,
    and everything emitted before was verified."""
    from vericache_sglang.core.compress import parse_spec
    from vericache_sglang.engine.decode import generate_full, generate_vericache
    from vericache_sglang.engine.fetch import FetchError
    from vericache_sglang.engine.generation import GenerationConfig
    from vericache_sglang.engine.prefill import prefill
    from vericache_sglang.full_kv.store import FullKVStore

    layers = tiny_runner.layout.num_layers
    tokens = list(range(3, 300))
    pre = prefill(tiny_runner, tokens)
    cfg = GenerationConfig(max_new_tokens=48, horizon=8, keep_logits=True)
    reference = generate_full(tiny_runner, pre, cfg)

    def rotate(n: int) -> None:
        if n == 2 * layers + 2:  # in the second verification's fetch
            token_store.kill()
            token_store.token = "rotated"
            token_store.start()

    backend = HookedStore(connect_store(token_store.url), rotate)
    store = FullKVStore(backend, tiny_runner.layout, namespace=uuid.uuid4().hex, chunk_tokens=32)
    emitted: list[int] = []
    try:
        with pytest.raises(FetchError, match="refused this server") as e:
            generate_vericache(
                tiny_runner, pre, parse_spec("snapkv:ratio=0.25,window=16"), store, cfg, on_commit=emitted.extend
            )
        assert refused(e.value)
        assert 0 < len(emitted) < 48 and emitted == reference.tokens[: len(emitted)]
    finally:
        token_store.kill()
        token_store.token = "s3cret"
        token_store.start()


def test_every_entry_point_connects_through_the_probe():
    """What opens a store for a run goes through connect_store (the probe), not open_store."""
    sources = {
        path: (REPO / path).read_text()
        for path in (
            "vericache_sglang/engine/engine.py",
            "vericache_sglang/sglang/full_kv/store_tier.py",
            "vericache_sglang/sglang/storage.py",
        )
    }
    for path, text in sources.items():
        assert "connect_store(" in text and "open_store(" not in text, path
