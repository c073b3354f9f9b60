"""Real SGLang server processes on this CPU for tests: SGLang's own launch command, as a user runs it.

``python -m sglang.launch_server --device cpu --attention-backend torch_native --dtype float32`` with
``SGLANG_USE_CPU_ENGINE=1`` (the CPU platform layer, ``vericache_sglang/sglang/cpu_platform.py``,
comes in through the project's ``.pth`` file). Each server is a process group of its own, so a
stop leaves nothing behind; ``--sleep-on-idle`` keeps an idle scheduler from spinning a core.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from services import free_port

REPO = Path(__file__).resolve().parents[1]
CPU_ARGS = ("--device", "cpu", "--attention-backend", "torch_native", "--dtype", "float32")
# Small pools keep several servers within this machine's memory; stats every step keep the
# token-usage gauges current for the tests that read them.
TEST_ARGS = ("--max-total-tokens", "16384", "--sleep-on-idle", "--decode-log-interval", "1", "--enable-metrics",
             "--enable-cache-report")


def model_dir() -> str:
    from vericache_sglang.engine.model import prepare_smollm2

    return str(prepare_smollm2(progress=False))


def launch_command(port: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "sglang.launch_server", "--model-path", model_dir(), *CPU_ARGS,
            "--port", str(port), *extra]


def cpu_env() -> dict[str, str]:
    return {**os.environ, "SGLANG_USE_CPU_ENGINE": "1", "PYTHONUNBUFFERED": "1"}


class SGLangServer:
    """One ``sglang.launch_server`` process (and the scheduler and detokenizer it spawns)."""

    def __init__(self, log_dir: Path, name: str, *extra: str, vericache: dict[str, Any] | None = None,
                 start_timeout: float = 300.0):
        self.name = name
        self.port = free_port()
        args = [*TEST_ARGS, *extra]
        if vericache is not None:
            args += ["--enable-vericache", "--vericache-config", json.dumps(vericache)]
        self.command = launch_command(self.port, *args)
        self.log_path = log_dir / f"{name}.log"
        self.log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.command, cwd=REPO, env=cpu_env(), stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        self._wait_healthy(start_timeout)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"SGLang server {self.name} exited ({self.proc.returncode}):\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        self.stop()
        raise RuntimeError(f"SGLang server {self.name} not healthy after {timeout:.0f} s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 60) -> str:
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(line for line in text if "Ignore import error" not in line and "server_args=" not in line)[
            -lines * 200:]

    def alive(self) -> bool:
        return self.proc.poll() is None

    def client(self, timeout: float = 600.0) -> Any:
        from openai import OpenAI

        return OpenAI(base_url=f"{self.url}/v1", api_key="none", timeout=timeout, max_retries=0)

    def generate(self, input_ids: list[int], sampling: dict[str, Any], timeout: float = 600.0) -> dict[str, Any]:
        """SGLang's native ``/generate`` on token ids: ``output_ids`` and ``meta_info``."""
        r = httpx.post(f"{self.url}/generate", json={"input_ids": input_ids, "sampling_params": sampling},
                       timeout=timeout)
        r.raise_for_status()
        return r.json()

    def metrics(self) -> dict[str, float]:
        """``/metrics`` samples by name (labels dropped; summed over label sets)."""
        out: dict[str, float] = {}
        for line in httpx.get(f"{self.url}/metrics", timeout=30).text.splitlines():
            if not line or line.startswith("#"):
                continue
            name_labels, _, value = line.rpartition(" ")
            name = name_labels.split("{", 1)[0]
            out[name] = out.get(name, 0.0) + float(value)
        return out

    def stop(self) -> int:
        """SIGTERM to the whole process group, SIGKILL if it lingers; returns the launcher's exit code."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)
            except ProcessLookupError:
                pass
        try:  # the scheduler and detokenizer too, whatever the launcher did
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.log.close()
        return self.proc.returncode


def group_alive(pid: int) -> bool:
    """Whether any process of the process group ``pid`` is left."""
    try:
        os.killpg(pid, 0)
        return True
    except ProcessLookupError:
        return False


def tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir())


def document_prompt(name: str, min_tokens: int) -> str:
    """A real prompt of ``benchmarks/prompts/NAME.txt`` cut to about ``min_tokens`` tokens: its
    document's first lines up to that length, then its closing question (the last paragraph)."""
    text = (REPO / "benchmarks" / "prompts" / f"{name}.txt").read_text().strip()
    body, question = text.rsplit("\n\n", 1)
    tok = tokenizer()
    lines = body.split("\n")
    kept = len(lines)
    for n in range(1, len(lines) + 1):
        if len(tok.encode("\n".join(lines[:n]) + "\n\n" + question)) >= min_tokens:
            kept = n
            break
    return "\n".join(lines[:kept]) + "\n\n" + question
