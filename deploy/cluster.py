"""docker-compose.yml's profiles on loopback, without Docker (``deploy/local_cluster.sh``).

The compose file is the only description of the cluster: each service's ``command``,
``environment``, ``healthcheck``, ``depends_on`` and ``restart`` are used as written, variables
(``${NAME:-default}``) substituted from the environment as Compose does, with three mappings a
single host needs: a service's host name and port (``store:50051``) become ``127.0.0.1`` and a
free port, ``/run/secrets/NAME`` becomes the secret's file, and executables come from the
service's ``x-local.venv`` (default ``.venv``) with the checkout on ``PYTHONPATH`` (the images'
``/app``). Volumes are not mapped: local runs use this machine's model cache.
tests/serve/test_cluster.py checks that this reading of the file agrees with Docker Compose's own.

    python deploy/cluster.py up [--profile cpu|sglang] [--exit-after-client] [--without lmcache]
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
COMPOSE = REPO / "docker-compose.yml"
CLIENTS = ("rag-client", "sglang-client")  # each profile's one-shot client, run after the rest is up
_VARIABLE = re.compile(r"\$\{(\w+)(?::?-([^}]*))?\}")


def interpolate(value: object) -> object:
    """Compose's variable substitution in every string: ``${NAME}``, ``${NAME:-default}``."""
    if isinstance(value, str):
        return _VARIABLE.sub(lambda m: os.environ.get(m.group(1)) or (m.group(2) or ""), value)
    if isinstance(value, list):
        return [interpolate(v) for v in value]
    if isinstance(value, dict):
        return {k: interpolate(v) for k, v in value.items()}
    return value


@dataclass
class Service:
    name: str
    command: list[str]
    environment: dict[str, str] = field(default_factory=dict)
    healthcheck: list[str] | None = None  # the test, in CMD form
    health_interval_s: float = 2.0
    health_retries: int = 30
    depends_on: dict[str, str] = field(default_factory=dict)  # name -> condition
    port: int | None = None  # the one port it listens on (compose `expose`)
    oneshot: bool = False  # restart: "no" (runs to completion)
    venv: str = ".venv"


def _seconds(value: str | int | float) -> float:
    text = str(value)
    for unit, scale in (("ms", 1e-3), ("s", 1.0), ("m", 60.0)):
        if text.endswith(unit):
            return float(text[: -len(unit)]) * scale
    return float(text)


def load(path: Path = COMPOSE, profile: str = "cpu") -> dict[str, Service]:
    """The services of ``profile``, as this runner reads them."""
    spec = interpolate(yaml.safe_load(path.read_text()))
    out = {}
    for name, svc in spec["services"].items():
        if profile not in svc.get("profiles", [profile]):
            continue
        health = svc.get("healthcheck") or {}
        test = health.get("test")
        if test is not None and test[0] != "CMD":
            raise ValueError(f"service {name}: healthcheck test must be in CMD form, got {test[0]}")
        deps = svc.get("depends_on") or {}
        if isinstance(deps, list):
            deps = {d: {"condition": "service_started"} for d in deps}
        expose = [int(p) for p in svc.get("expose", [])]
        if len(expose) > 1:
            raise ValueError(f"service {name}: one exposed port at most, got {expose}")
        env = svc.get("environment") or {}
        if isinstance(env, list):
            env = dict(item.split("=", 1) for item in env)
        out[name] = Service(
            name,
            [str(a) for a in svc["command"]],
            {k: str(v) for k, v in env.items()},
            None if test is None else [str(a) for a in test[1:]],
            _seconds(health.get("interval", "2s")),
            int(health.get("retries", 30)),
            {d: c.get("condition", "service_started") for d, c in deps.items()},
            expose[0] if expose else None,
            str(svc.get("restart", "no")) == "no",
            (svc.get("x-local") or {}).get("venv", ".venv"),
        )
    return out


def order(services: dict[str, Service]) -> list[str]:
    """Start order: every service after what it depends on."""
    done: list[str] = []

    def visit(name: str, path: tuple[str, ...]) -> None:
        if name in done:
            return
        if name in path:
            raise ValueError(f"dependency cycle: {' -> '.join((*path, name))}")
        for dep in services[name].depends_on:
            if dep not in services:
                raise ValueError(f"service {name} depends on {dep}, which is not in this profile")
            visit(dep, (*path, name))
        done.append(name)

    for name in services:
        visit(name, ())
    return done


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def localize(
    args: list[str], own: Service, ports: dict[str, int], services: dict[str, Service], secrets: dict[str, Path]
) -> list[str]:
    """A service's arguments on loopback: host names and ports mapped, secrets to their files."""
    out = []
    for arg in args:
        for name, svc in services.items():
            if svc.port is not None:
                arg = arg.replace(f"{name}:{svc.port}", f"127.0.0.1:{ports[name]}")
        if own.port is not None:
            m = str(ports[own.name])
            arg = arg.replace(f"0.0.0.0:{own.port}", f"127.0.0.1:{m}").replace(
                f"localhost:{own.port}", f"127.0.0.1:{m}"
            )
            arg = m if arg == str(own.port) else arg
        arg = "127.0.0.1" if arg == "0.0.0.0" else arg
        for secret, file in secrets.items():
            arg = arg.replace(f"/run/secrets/{secret}", str(file))
        out.append(arg)
    return out


class LocalCluster:
    def __init__(self, services: dict[str, Service], workdir: Path, secrets: dict[str, Path]):
        self.services = services
        self.workdir = workdir
        self.secrets = secrets
        self.ports = {n: free_port() for n, s in services.items() if s.port is not None}
        self.procs: dict[str, subprocess.Popen] = {}
        self.exit_codes: dict[str, int] = {}

    @classmethod
    def from_compose(
        cls, workdir: Path, path: Path = COMPOSE, profile: str = "cpu", without: tuple[str, ...] = ()
    ) -> LocalCluster:
        services = {n: s for n, s in load(path, profile).items() if n not in without}
        spec = yaml.safe_load(path.read_text())
        secrets = {}
        for name in spec.get("secrets", {}):  # fresh secrets for this run, never the repository's
            file = workdir / "secrets" / name
            file.parent.mkdir(parents=True, exist_ok=True)
            file.write_text(os.urandom(16).hex() + "\n")
            file.chmod(0o600)
            secrets[name] = file
        return cls(services, workdir, secrets)

    def url(self, name: str, scheme: str = "http") -> str:
        return f"{scheme}://127.0.0.1:{self.ports[name]}"

    def argv(self, name: str) -> list[str]:
        svc = self.services[name]
        return localize(svc.command, svc, self.ports, self.services, self.secrets)

    def env(self, name: str) -> dict[str, str]:
        svc = self.services[name]
        env = dict(os.environ)
        env["PATH"] = f"{REPO / svc.venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
        env["PYTHONPATH"] = str(REPO)
        env.pop("VIRTUAL_ENV", None)
        for key, value in svc.environment.items():
            env[key] = localize([value], svc, self.ports, self.services, self.secrets)[0]
        return env

    def start(self, name: str) -> subprocess.Popen:
        with open(self.workdir / f"{name}.log", "ab") as log:  # the child keeps its own descriptor
            proc = subprocess.Popen(
                self.argv(name),
                env=self.env(name),
                cwd=REPO,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.procs[name] = proc
        return proc

    def healthy(self, name: str) -> bool:
        svc = self.services[name]
        if svc.healthcheck is None:
            return self.procs[name].poll() is None
        args = localize(svc.healthcheck, svc, self.ports, self.services, self.secrets)
        try:
            return subprocess.run(args, env=self.env(name), cwd=REPO, capture_output=True, timeout=30).returncode == 0
        except subprocess.TimeoutExpired:
            return False

    def wait(self, name: str, condition: str) -> None:
        svc, proc = self.services[name], self.procs[name]
        if condition == "service_completed_successfully":
            rc = proc.wait(timeout=1800)
            if rc != 0:
                raise RuntimeError(f"{name} exited with {rc}; see {self.workdir / (name + '.log')}")
            return
        if condition == "service_started":
            return
        for _ in range(svc.health_retries * 10):  # generous: first starts load a model
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}; see {self.workdir / (name + '.log')}")
            if self.healthy(name):
                return
            time.sleep(svc.health_interval_s)
        raise RuntimeError(f"{name} did not become healthy; see {self.workdir / (name + '.log')}")

    @property
    def client(self) -> str | None:
        """This profile's client service, if it has one."""
        return next((name for name in CLIENTS if name in self.services), None)

    def up(self, skip: tuple[str, ...] = CLIENTS, log=print) -> None:
        """Start every service (but ``skip``) in dependency order, each after its dependencies'
        conditions hold; return when every long-running one is healthy."""
        for name in order(self.services):
            if name in skip:
                continue
            for dep, condition in self.services[name].depends_on.items():
                self.wait(dep, condition)
            self.start(name)
            log(f"started {name}: {shlex.join(self.argv(name))}")
        for name, svc in self.services.items():
            if name not in skip and not svc.oneshot:
                self.wait(name, "service_healthy")
                log(f"{name} healthy")

    def run_client(
        self, name: str | None = None, extra: tuple[str, ...] = (), timeout_s: float = 1800
    ) -> subprocess.CompletedProcess:
        name = name or self.client
        for dep, condition in self.services[name].depends_on.items():
            self.wait(dep, condition)
        return subprocess.run(
            self.argv(name) + list(extra),
            env=self.env(name),
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )

    def stop(self, name: str, sig: int = signal.SIGTERM, grace_s: float = 20.0) -> int:
        proc = self.procs.pop(name)
        if proc.poll() is None:
            os.killpg(proc.pid, sig)
            try:
                proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self.exit_codes[name] = proc.returncode
        return proc.returncode

    def down(self) -> dict[str, int]:
        """SIGTERM every service, dependents first; returns their exit codes (a clean stop is 0)."""
        for name in reversed(order(self.services)):
            if name in self.procs:
                self.stop(name)
        return self.exit_codes


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="deploy/local_cluster.sh", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("action", choices=("up", "plan"))
    p.add_argument("--profile", default="cpu")
    p.add_argument("--without", action="append", default=[], help="leave a service out (repeatable)")
    p.add_argument("--exit-after-client", action="store_true", help="stop the cluster when the RAG client is done")
    p.add_argument("--workdir", type=Path, help="logs and secrets (default: a temporary folder)")
    args = p.parse_args(argv)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="vericache-cluster-"))
    workdir.mkdir(parents=True, exist_ok=True)
    cluster = LocalCluster.from_compose(workdir, profile=args.profile, without=tuple(args.without))
    if args.action == "plan":
        for name in order(cluster.services):
            print(f"{name}: {shlex.join(cluster.argv(name))}")
        return 0
    print(f"logs in {workdir}", file=sys.stderr)
    rc = 0
    try:
        cluster.up(log=lambda s: print(s, file=sys.stderr))
        if cluster.client is not None:
            done = cluster.run_client()
            print(done.stderr, file=sys.stderr, end="")
            print(done.stdout, end="")
            rc = done.returncode
        if not args.exit_after_client:
            print(
                "cluster up: " + ", ".join(f"{n} {cluster.url(n)}" for n in cluster.ports) + " (Ctrl-C stops it)",
                file=sys.stderr,
            )
            signal.sigwait({signal.SIGINT, signal.SIGTERM})
    finally:
        codes = cluster.down()
        print("stopped: " + ", ".join(f"{n} ({c})" for n, c in codes.items()), file=sys.stderr)
    return rc


if __name__ == "__main__":
    sys.exit(main())
