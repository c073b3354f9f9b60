"""Real services on loopback for tests: redis-server and our store server, started and stopped here.

CI starts one of each (see .ci/run) and exports VERICACHE_TEST_REDIS_URL / VERICACHE_TEST_STORE_URL;
tests that need a server of their own (to kill, restart or fill it) always start one.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import redis

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def redis_available() -> bool:
    return shutil.which("redis-server") is not None


class RedisServer:
    def __init__(
        self,
        tmp: Path,
        maxmemory: str | None = None,
        password: str | None = None,
        tls: tuple[Path, Path, Path] | None = None,
    ):
        self.port = free_port()
        self.password = password
        self.tls = tls
        self.tmp = tmp
        args = [
            "redis-server",
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(tmp),
            "--maxmemory-policy",
            "volatile-lru",
        ]
        if maxmemory:
            args += ["--maxmemory", maxmemory, "--maxmemory-samples", "10"]
        if password:
            args += ["--requirepass", password]
        if tls:
            cert, key, ca = tls
            args += [
                "--port",
                "0",
                "--tls-port",
                str(self.port),
                "--tls-cert-file",
                str(cert),
                "--tls-key-file",
                str(key),
                "--tls-ca-cert-file",
                str(ca),
                "--tls-auth-clients",
                "no",
            ]
        else:
            args += ["--port", str(self.port)]
        self.args = args
        self.proc: subprocess.Popen | None = None
        self.start()

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        if self.tls:
            return f"rediss://{auth}127.0.0.1:{self.port}/0?ssl_ca_certs={self.tls[2]}"
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(self.args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis.from_url(self.url, socket_timeout=1)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                return
            except redis.RedisError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError(f"redis-server did not start: {' '.join(self.args)}") from None
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)

    def restart(self) -> None:
        self.stop()
        self.start()


class RedisCluster:
    """A real Redis Cluster on loopback: ``nodes`` redis-server processes in cluster mode, their
    slots assigned by ``redis-cli --cluster create`` (primaries only)."""

    def __init__(self, tmp: Path, nodes: int = 3):
        self.ports = [free_port() for _ in range(nodes)]
        self.procs: list[subprocess.Popen] = []
        for port in self.ports:  # the cluster bus on a port of its own, not PORT+10000 (past 65535 here)
            d = tmp / str(port)
            d.mkdir(parents=True, exist_ok=True)
            args = ["redis-server", "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no"]
            args += ["--dir", str(d), "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"]
            args += ["--cluster-port", str(free_port())]
            # a cache: the nodes left keep serving their slots when one goes down
            args += ["--maxmemory-policy", "volatile-lru", "--cluster-require-full-coverage", "no"]
            self.procs.append(subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        try:
            for port in self.ports:
                _wait_ping(redis.Redis(port=port, socket_timeout=1), f"redis-server --cluster-enabled on {port}")
        except RuntimeError:
            self.stop()
            raise
        create = ["redis-cli", "--cluster", "create", *(f"127.0.0.1:{p}" for p in self.ports)]
        done = subprocess.run([*create, "--cluster-replicas", "0", "--cluster-yes"], capture_output=True, text=True)
        if done.returncode != 0:
            self.stop()
            raise RuntimeError(f"redis-cli --cluster create failed: {done.stdout[-500:]}{done.stderr[-500:]}")
        deadline = time.monotonic() + 30
        while any(redis.Redis(port=p).cluster("info").get("cluster_state") != "ok" for p in self.ports):
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("the Redis Cluster did not reach state ok")
            time.sleep(0.1)

    @property
    def url(self) -> str:
        return f"redis-cluster://127.0.0.1:{self.ports[0]}"

    def kill(self, i: int) -> None:
        self.procs[i].kill()
        self.procs[i].wait(10)

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(10)


def _wait_ping(client: redis.Redis, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            client.ping()
            return
        except redis.RedisError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} did not start") from None
            time.sleep(0.05)


class StoreServer:
    """``python -m remote_store.server`` in a subprocess."""

    def __init__(
        self,
        tmp: Path,
        capacity_bytes: int = 1 << 30,
        token: str | None = "test-token",
        tls: tuple[Path, Path] | None = None,
        pin_ttl_s: float | None = None,
    ):
        self.tmp = tmp
        self.pin_ttl_s = pin_ttl_s
        self.token = token
        self.tls = tls
        self.capacity_bytes = capacity_bytes
        self.port = free_port()
        self.proc: subprocess.Popen | None = None
        self.start()

    @property
    def url(self) -> str:
        auth = f":{self.token}@" if self.token else ""
        if self.tls:
            return f"grpcs://{auth}127.0.0.1:{self.port}?ca={self.tls[0]}&server_name=localhost"
        return f"grpc://{auth}127.0.0.1:{self.port}"

    def start(self) -> None:
        args = [
            sys.executable,
            "-m",
            "remote_store.server",
            "--listen",
            f"127.0.0.1:{self.port}",
            "--capacity-bytes",
            str(self.capacity_bytes),
            "--port-file",
            str(self.tmp / "port"),
        ]
        if self.token:
            (self.tmp / "token").write_text(self.token)
            args += ["--auth-token-file", str(self.tmp / "token")]
        if self.pin_ttl_s is not None:
            args += ["--pin-ttl-s", str(self.pin_ttl_s)]
        if self.tls:
            args += ["--tls-cert", str(self.tls[0]), "--tls-key", str(self.tls[1])]
        (self.tmp / "port").unlink(missing_ok=True)
        self.log = open(self.tmp / "server.log", "ab")
        self.proc = subprocess.Popen(args, cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while not (self.tmp / "port").exists():
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError(f"store server did not start: {(self.tmp / 'server.log').read_text()[-2000:]}")
            time.sleep(0.05)

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> int:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            return self.proc.wait(20)
        return self.proc.returncode if self.proc else 0


def self_signed_cert(tmp: Path) -> tuple[Path, Path]:
    """A self-signed certificate for localhost (its own CA), made with the openssl CLI."""
    cert, key = tmp / "cert.pem", tmp / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "2",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=DNS:localhost,IP:127.0.0.1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
    )
    return cert, key


def env_url(name: str) -> str | None:
    return os.environ.get(name) or None


LMCACHE_PYTHON = REPO / ".venv-lmcache" / "bin" / "python"


def lmcache_available() -> bool:
    return LMCACHE_PYTHON.exists()


class LMCacheSidecar(StoreServer):
    """``python -m remote_store.lmcache_sidecar`` in the LMCache environment, over a Redis URL."""

    def __init__(self, tmp: Path, remote_url: str, token: str | None = "test-token"):
        self.remote_url = remote_url
        super().__init__(tmp, token=token)

    @property
    def url(self) -> str:
        auth = f":{self.token}@" if self.token else ""
        return f"lmcache://{auth}127.0.0.1:{self.port}"

    def start(self) -> None:
        args = [
            str(LMCACHE_PYTHON),
            "-m",
            "remote_store.lmcache_sidecar",
            "--listen",
            f"127.0.0.1:{self.port}",
            "--remote-url",
            self.remote_url,
            "--local-cpu-gb",
            "0.25",
            "--port-file",
            str(self.tmp / "port"),
        ]
        if self.token:
            (self.tmp / "token").write_text(self.token)
            args += ["--auth-token-file", str(self.tmp / "token")]
        (self.tmp / "port").unlink(missing_ok=True)
        self.log = open(self.tmp / "sidecar.log", "ab")
        env = {**os.environ, "PYTHONPATH": str(REPO), "LMCACHE_TRACK_USAGE": "false"}
        self.proc = subprocess.Popen(args, cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 120  # importing LMCache takes several seconds
        while not (self.tmp / "port").exists():
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError(f"LMCache sidecar did not start: {(self.tmp / 'sidecar.log').read_text()[-3000:]}")
            time.sleep(0.1)
