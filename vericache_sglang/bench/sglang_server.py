"""SGLang server processes, for the SGLang benchmarks and the end-to-end tests: SGLang's own launch
command, as a user runs it.

On this CPU (``CPU``, the default): ``python -m sglang.launch_server --device cpu --attention-backend
torch_native --dtype float32`` with ``SGLANG_USE_CPU_ENGINE=1`` (the CPU platform layer,
``vericache_sglang/sglang/cpu/platform.py``, comes in through the project's ``.pth`` file). On a GPU
without SGLang's kernel packages (``CUDA_TORCH``, the GPU check): the triton attention backend, torch
sampling and the platform layer's stand-in ``sgl_kernel``. Each server is a process group of its own, so a
stop leaves nothing behind. No sglang import here: the servers are other processes.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[2]
CPU_ARGS = ("--device", "cpu", "--attention-backend", "torch_native", "--dtype", "float32")


@dataclass(frozen=True)
class Platform:
    """Where a server runs: the launch arguments and environment that choose its device and kernels."""

    name: str
    args: tuple[str, ...]
    env: tuple[tuple[str, str], ...]


# OpenMP workers that spin while waiting starve a second server's on the same cores: two servers
# decoding at once ran 5x slower than one after the other; passive waiting, no slower alone
CPU = Platform("cpu", CPU_ARGS, (("SGLANG_USE_CPU_ENGINE", "1"), ("OMP_WAIT_POLICY", "PASSIVE")))
# The GPU path on this CPU: SGLang's triton backend with Triton's kernels run by its interpreter;
# --enable-deterministic-inference answered on CPU by the platform layer (VERICACHE_CPU_DETERMINISTIC)
CPU_TRITON = Platform(
    "cpu-triton",
    ("--device", "cpu", "--attention-backend", "triton", "--dtype", "float32"),
    (*CPU.env, ("TRITON_INTERPRET", "1"), ("VERICACHE_CPU_DETERMINISTIC", "1")),
)
# A CUDA GPU without sgl_kernel, cutlass or flashinfer (the lent machines). UNVERIFIED: never run on
# a GPU. SGLang's CUDA modules load through the platform layer's stand-ins (VERICACHE_TORCH_KERNELS,
# sglang/cpu/cuda_stand_in.py; tested here with CUDA faked), and this environment keeps calls off
# them: fused layers in torch (the switch covers SiluAndMul, RMSNorm, rotary and the position
# clamp, whose JIT kernels need nvcc), no check of an installed sglang-kernel, and no attempt to
# JIT-compile the KV write kernel. (The image's torch 2.11 also needs SGLang's Python radix-tree
# core: scripts/gpu_check.sh, which installs onto that image, sets it for the dry run too.)
CUDA_TORCH = Platform(
    "cuda",
    (
        "--device",
        "cuda",
        "--attention-backend",
        "triton",
        "--sampling-backend",
        "pytorch",
        "--cuda-graph-backend-decode",
        "disabled",
        "--cuda-graph-backend-prefill",
        "disabled",
        "--disable-custom-all-reduce",
        "--bf16-gemm-backend",
        "torch",
    ),
    (
        ("VERICACHE_TORCH_KERNELS", "1"),
        ("SGLANG_FORCE_FUSED_OP_BACKEND", "torch"),
        ("SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK", "1"),
        ("SGLANG_CRASH_ON_JIT_COMPILE", "1"),
    ),
)
PLATFORMS = {p.name: p for p in (CPU, CPU_TRITON, CUDA_TORCH)}
# A small pool keeps several servers within a 24 GiB machine; --sleep-on-idle keeps an idle
# scheduler from spinning a core; stats every step keep the token-usage gauge current.
SMALL_SERVER_ARGS = (
    "--max-total-tokens",
    "16384",
    "--sleep-on-idle",
    "--decode-log-interval",
    "1",
    "--enable-metrics",
    "--enable-cache-report",
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def model_dir() -> str:
    from vericache_sglang.engine.model import prepare_smollm2

    return str(prepare_smollm2(progress=False))


def launch_command(port: int, *extra: str, platform: Platform = CPU, model: str | None = None) -> list[str]:
    """SGLang's launcher on ``platform`` for ``model`` (default: SmolLM2); ``extra`` comes last and wins."""
    return [
        sys.executable,
        "-m",
        "sglang.launch_server",
        "--model-path",
        model or model_dir(),
        *platform.args,
        "--port",
        str(port),
        *extra,
    ]


def server_env(platform: Platform = CPU) -> dict[str, str]:
    env = dict(platform.env)
    passive = env.pop("OMP_WAIT_POLICY", None)  # a default the caller's environment may override
    return {**({"OMP_WAIT_POLICY": passive} if passive else {}), **os.environ, **env, "PYTHONUNBUFFERED": "1"}


def cpu_env() -> dict[str, str]:
    return server_env(CPU)


class SGLangServer:
    """One ``sglang.launch_server`` process (and the scheduler and detokenizer it spawns)."""

    def __init__(
        self,
        log_dir: Path,
        name: str,
        *extra: str,
        vericache: dict[str, Any] | None = None,
        env: dict[str, str] | None = None,
        start_timeout: float = 300.0,
        wait: bool = True,
        platform: Platform = CPU,
        model: str | None = None,
    ):
        """Launch it; with ``wait`` (the default) return once it is healthy, else call ``wait_healthy``
        (servers started together load their models side by side)."""
        self.name = name
        self._args = [*SMALL_SERVER_ARGS, *extra]
        if vericache is not None:
            self._args += ["--enable-vericache", "--vericache-config", json.dumps(vericache)]
        self._platform, self._model = platform, model
        self._env = {**server_env(platform), **(env or {})}
        self.log_path = log_dir / f"{name}.log"
        self.log = open(self.log_path, "ab")
        self._launch()
        if wait:
            self.wait_healthy(start_timeout)

    def _launch(self) -> None:
        self.port = free_port()
        self.command = launch_command(self.port, *self._args, platform=self._platform, model=self._model)
        self._log_start = os.path.getsize(self.log_path)
        self.proc = subprocess.Popen(
            self.command,
            cwd=REPO,
            env=self._env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self._started = time.monotonic()
        self._healthy = False

    def _port_taken(self) -> bool:
        """Whether this launch's HTTP server lost its port to another process (free_port only
        finds a port that was free when asked); SGLang then waits instead of exiting."""
        with open(self.log_path, "rb") as f:
            f.seek(self._log_start)
            return b"error while attempting to bind on address" in f.read()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_healthy(self, timeout: float = 300.0) -> None:
        """Return once ``/health`` answers, at most ``timeout`` s after the launch; stop it and raise if not."""
        if self._healthy:
            return
        deadline, relaunches = self._started + timeout, 0
        while True:  # asked at least once: a server launched long before may be up by now
            if relaunches < 3 and self._port_taken():  # before /health: that port answers for another process
                self._kill()
                self.log.write(b"\n[test harness] the port was taken: relaunching on another\n")
                self.log.flush()
                self._launch()
                deadline, relaunches = self._started + timeout, relaunches + 1
            if self.proc.poll() is not None:
                raise RuntimeError(f"SGLang server {self.name} exited ({self.proc.returncode}):\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    self._healthy = True
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() >= deadline:
                break
            time.sleep(1)
        self.stop()
        raise RuntimeError(f"SGLang server {self.name} not healthy after {timeout:.0f} s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 60) -> str:
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(line for line in text if "Ignore import error" not in line and "server_args=" not in line)[
            -lines * 200 :
        ]

    def alive(self) -> bool:
        return self.proc.poll() is None

    def client(self, timeout: float = 600.0) -> Any:
        from openai import OpenAI

        return OpenAI(base_url=f"{self.url}/v1", api_key="none", timeout=timeout, max_retries=0)

    def generate(self, input_ids: list[int], sampling: dict[str, Any], timeout: float = 600.0) -> dict[str, Any]:
        """SGLang's native ``/generate`` on token ids: ``output_ids`` and ``meta_info``."""
        r = httpx.post(
            f"{self.url}/generate", json={"input_ids": input_ids, "sampling_params": sampling}, timeout=timeout
        )
        r.raise_for_status()
        return r.json()

    def _samples(self) -> Iterator[tuple[str, dict[str, str], float]]:
        """``/metrics`` as ``(name, labels, value)``, one per sample."""
        for line in httpx.get(f"{self.url}/metrics", timeout=30).text.splitlines():
            if not line or line.startswith("#"):
                continue
            name_labels, _, value = line.rpartition(" ")
            name, _, labels = name_labels.partition("{")
            pairs = (pair.partition("=") for pair in labels.rstrip("}").split(",") if pair)
            yield name, {key: val.strip('"') for key, _, val in pairs}, float(value)

    def metrics(self) -> dict[str, float]:
        """``/metrics`` samples by name (labels dropped; summed over label sets)."""
        out: dict[str, float] = {}
        for name, _, value in self._samples():
            out[name] = out.get(name, 0.0) + value
        return out

    def labelled(self, name: str, label: str) -> dict[str, float]:
        """The samples of ``/metrics`` series ``name`` summed by the value of ``label``."""
        out: dict[str, float] = {}
        for sample, labels, value in self._samples():
            if sample == name and label in labels:
                out[labels[label]] = out.get(labels[label], 0.0) + value
        return out

    def stop(self) -> int:
        """SIGTERM to the whole process group, SIGKILL if it lingers; returns the launcher's exit code."""
        self._kill()
        self.log.close()
        return self.proc.returncode

    def _kill(self) -> None:
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


def group_alive(pid: int) -> bool:
    """Whether any process of the process group ``pid`` is left."""
    try:
        os.killpg(pid, 0)
        return True
    except ProcessLookupError:
        return False


# -- requests through the official openai client ----------------------------------------------------

MODEL = "default"


@dataclass(frozen=True)
class Ask:
    """One request: ``kind`` "chat" or "completion", streamed or not."""

    prompt: str
    kind: str = "chat"
    stream: bool = False
    max_tokens: int = 64
    params: dict[str, Any] = field(default_factory=dict)  # temperature, stop, logprobs, response_format, ...
    system: str | None = None

    def label(self) -> str:
        return f"{self.kind}{'-stream' if self.stream else ''}"


@dataclass
class Answer:
    text: str
    finish_reason: str | None
    logprobs: list[float] | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None  # non-streamed answers
    prompt_tokens: int | None = None


def ask(server: SGLangServer, q: Ask) -> Answer:
    client = server.client()
    params = {"temperature": 0.0, **q.params}
    if q.kind == "completion":
        if q.stream:
            text, finish = "", None
            for chunk in client.completions.create(
                model=MODEL, prompt=q.prompt, max_tokens=q.max_tokens, stream=True, **params
            ):
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
            return Answer(text, finish)
        r = client.completions.create(model=MODEL, prompt=q.prompt, max_tokens=q.max_tokens, **params)
        logprobs = r.choices[0].logprobs.token_logprobs if r.choices[0].logprobs else None
        return Answer(r.choices[0].text, r.choices[0].finish_reason, logprobs, _cached(r), *_counts(r.usage))
    messages = ([{"role": "system", "content": q.system}] if q.system else []) + [{"role": "user", "content": q.prompt}]
    if q.stream:
        text, finish = "", None
        for chunk in client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=q.max_tokens, stream=True, **params
        ):
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
        return Answer(text, finish)
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=q.max_tokens, **params)
    choice = r.choices[0]
    logprobs = [t.logprob for t in choice.logprobs.content] if choice.logprobs and choice.logprobs.content else None
    return Answer(choice.message.content or "", choice.finish_reason, logprobs, _cached(r), *_counts(r.usage))


def _counts(usage: Any) -> tuple[int, int]:
    return usage.completion_tokens, usage.prompt_tokens


def _cached(r: Any) -> int | None:
    details = getattr(r.usage, "prompt_tokens_details", None)
    return getattr(details, "cached_tokens", None) if details is not None else None


def ask_all(server: SGLangServer, questions: list[Ask]) -> list[Answer]:
    """All at once (they run as one continuous batch on the server)."""
    # the openai client imports its resources on first use: threads doing that at once can meet
    # Python's import-lock deadlock detection (_DeadlockError, seen in the heavy set)
    import openai.resources  # noqa: F401

    with cf.ThreadPoolExecutor(len(questions)) as pool:
        return list(pool.map(lambda q: ask(server, q), questions))


@dataclass
class Load:
    """A load's answers, its wall time and the device KV pool's peak token usage during it."""

    answers: list[Answer]
    seconds: float
    peak_tokens: float


@contextlib.contextmanager
def peak_tokens(server: SGLangServer, poll_s: float = 0.2) -> Iterator[list[float]]:
    """SGLang's ``sglang:num_used_tokens`` (KV slots held by running requests: the tree's evictable
    ones excluded) polled while the block runs; its peak is ``[0]`` of what it yields, once done."""
    peak, done = [0.0], threading.Event()

    def watch() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], server.metrics().get("sglang:num_used_tokens", 0.0))
            time.sleep(poll_s)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        yield peak
    finally:
        done.set()
        watcher.join()


def run_load(server: SGLangServer, questions: list[Ask], poll_s: float = 0.2) -> Load:
    """All ``questions`` at once, the device KV pool's peak token usage watched the while."""
    t0 = time.perf_counter()
    with peak_tokens(server, poll_s) as peak:
        answers = ask_all(server, questions)
        seconds = time.perf_counter() - t0
    return Load(answers, seconds, peak[0])


def metric_growth(metrics: dict[str, float], before: dict[str, float] | None, name: str) -> float:
    """How much ``/metrics`` sample ``name`` grew since ``before`` (a series not yet exported counts as 0)."""
    return metrics.get(name, 0.0) - (before or {}).get(name, 0.0)


def accepted_length(metrics: dict[str, float], before: dict[str, float] | None = None) -> float:
    """Tokens committed per verification over a VeriCache server's drafting requests (its
    ``/metrics``, since ``before`` when given)."""
    total = metric_growth(metrics, before, "vericache_accepted_length_sum")
    count = metric_growth(metrics, before, "vericache_accepted_length_count")
    return total / count if count else 0.0


def tokenizer(model: str | None = None) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model or model_dir())


def document_prompt(name: str, min_tokens: int, tok: Any = None) -> str:
    """A real prompt of ``benchmarks/prompts/NAME.txt`` cut to about ``min_tokens`` tokens (of ``tok``,
    default SmolLM2's): its document's first lines up to that length, then its closing question."""
    text = (REPO / "benchmarks" / "prompts" / f"{name}.txt").read_text().strip()
    body, question = text.rsplit("\n\n", 1)
    tok = tok or tokenizer()
    lines = body.split("\n")
    kept = len(lines)
    for n in range(1, len(lines) + 1):
        if len(tok.encode("\n".join(lines[:n]) + "\n\n" + question)) >= min_tokens:
            kept = n
            break
    return "\n".join(lines[:kept]) + "\n\n" + question
