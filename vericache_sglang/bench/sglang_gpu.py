"""The one-shot GPU check: stock SGLang against VeriCache servers on a lent GPU machine that has torch
and Triton but no sglang, sgl_kernel or flashinfer (``vericache bench sglang-gpu``; config
``benchmarks/configs/sglang_gpu.json``; ``scripts/gpu_check.sh`` installs the carried bundle of
``scripts/build_gpu_bundle.sh`` and runs it). ``--quick`` is its dry run on this CPU: the same steps,
SGLang's triton backend under Triton's interpreter, a two-layer model.

UNVERIFIED ON A GPU: never run on one. SGLang on CUDA loads through the platform layer's stand-ins
of ``sgl_kernel`` and the CuTe DSL dual GEMM (``sglang/cpu/cuda_stand_in.py``, tested here with CUDA
faked) with the environment of ``sglang_server.CUDA_TORCH``.

Steps, each server alone, one after the other, with the results written after every server (a run
cut short by its lease still returns what it measured):

1. the model: a random Llama of the config's shape, drawn from a fixed seed on the machine with the
   carried SmolLM2 tokenizer (the weights do not fit in what travels); its answers are not language,
   so drafting acceptance here says nothing about real models. An operator whose machine has real
   weights and SGLang names them instead (``"model": {"path": ...}`` in a ``--config`` file);
2. the reference, stock SGLang, then VeriCache with ``full_kv`` host, device and store (our gRPC
   store server on loopback), all with the same flags and a device KV budget of a quarter of the
   long-context load's full KV (``--max-total-tokens``);
3. on each: the exactness requests (greedy with logprobs, a streamed chat, a seeded sample, a JSON
   schema), then the long-context load (concurrent requests over long prompts) for tokens/s, peak
   device KV and accepted length; every answer compared with stock's, text and finish reason, and
   the largest difference of the greedy answers' token logprobs reported.

Writes ``STEM.json`` and ``STEM.md`` (stem ``sglang_gpu``, ``sglang_gpu_quick`` for the dry run).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from functools import partial
from pathlib import Path
from typing import Any

from vericache_sglang.bench.common import REPO, load_config, table
from vericache_sglang.bench.sglang_cpu import store_server
from vericache_sglang.bench.sglang_server import (
    PLATFORMS,
    Answer,
    Ask,
    Platform,
    SGLangServer,
    accepted_length,
    ask,
    document_prompt,
    metric_growth,
    run_load,
    server_env,
    tokenizer,
)

BUNDLED_TOKENIZER = REPO / ".gpu_bundle" / "tokenizer"
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


def _tokenizer_dir() -> Path:
    """The carried tokenizer (the bundle's) where there is one, else the local SmolLM2 cache."""
    if (BUNDLED_TOKENIZER / "tokenizer.json").is_file():
        return BUNDLED_TOKENIZER
    from vericache_sglang.engine.model import prepare_smollm2

    return prepare_smollm2(progress=False)


def _environment(platform: Platform) -> dict[str, Any]:
    """What the servers will run on, read by a process with the servers' environment."""
    probe = (
        "import json, platform, sys, torch, triton\n"
        "out = {'python': platform.python_version(), 'torch': torch.__version__, 'triton': triton.__version__,\n"
        "       'cuda': torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}\n"
        "try:\n"
        "    import sglang; out['sglang'] = sglang.__version__\n"
        "    import sgl_kernel; out['sgl_kernel'] = 'stand-in' if getattr(sgl_kernel, 'VERICACHE_STAND_IN', False)"
        " else getattr(sgl_kernel, '__version__', 'real')\n"
        "except Exception as e:\n"
        "    out['import_error'] = repr(e)\n"
        "print(json.dumps(out))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], env=server_env(platform), capture_output=True, text=True, timeout=300
    )
    if done.returncode != 0:
        return {"probe_error": done.stderr[-2000:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def _questions(cfg: dict, tok: Any) -> list[Ask]:
    ex = cfg["exactness"]
    n, m = ex["prompt_tokens"], ex["max_tokens"]
    person = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    return [
        Ask(document_prompt("prose", n, tok), "completion", max_tokens=m, params={"logprobs": 1}),
        Ask(document_prompt("code", n, tok), "chat", stream=True, max_tokens=m),
        Ask(document_prompt("tools", n, tok), "completion", max_tokens=m, params={"temperature": 0.8, "seed": 7}),
        Ask("Give me a person as JSON.", "chat", max_tokens=m, params={"response_format": person}),
    ]


def _long_load(cfg: dict, tok: Any) -> list[Ask]:
    lc = cfg["long_context"]
    names = ("prose", "code", "tools")
    docs = {name: document_prompt(name, lc["prompt_tokens"], tok) for name in names}
    # each request opens with its own number: no two share a cached prefix
    return [
        Ask(f"Request {i}.\n\n{docs[names[i % 3]]}", "completion", max_tokens=lc["max_tokens"])
        for i in range(lc["requests"])
    ]


def _compare(reference: list[Answer], answers: list[Answer]) -> tuple[int, float | None]:
    """How many answers are the reference's (text and finish reason), and the largest difference of
    their token logprobs where both carry them."""
    same = sum(a.text == b.text and a.finish_reason == b.finish_reason for a, b in zip(reference, answers, strict=True))
    diffs = [
        abs(x - y)
        for a, b in zip(reference, answers, strict=True)
        if a.logprobs and b.logprobs
        for x, y in zip(a.logprobs, b.logprobs, strict=False)  # a differing answer may differ in length
        if x is not None and y is not None
    ]
    return same, max(diffs) if diffs else None


def _vericache_config(cfg: dict, mode: str, store_url: str) -> dict:
    out = {**cfg["vericache"], "full_kv": mode}
    if mode == "store":
        out["store"] = store_url
    if mode in ("store", "host"):
        out.update(cfg.get("offload", {}))
    if mode == "host":
        out.update(cfg.get("host", {}))
    return out


def run(config_path: Path | None = None, quick: bool = False, out_dir: Path | None = None, log=print) -> dict:
    from vericache_sglang.engine.model_variants import random_model

    t_start = time.monotonic()
    cfg = load_config("sglang_gpu", config_path, quick)
    platform = PLATFORMS[cfg["platform"]]
    out = Path(out_dir) if out_dir else Path(tempfile.mkdtemp(prefix="vericache-sglang-gpu-"))
    out.mkdir(parents=True, exist_ok=True)
    stem = "sglang_gpu" + ("_quick" if quick else "")
    logs = out / f"{stem}_logs"
    logs.mkdir(exist_ok=True)
    summary: dict[str, Any] = {"config": {k: v for k, v in cfg.items() if k != "quick"}, "quick": quick, "rows": []}
    summary["environment"] = _environment(platform)
    log(f"SGLang GPU check on {platform.name}: {json.dumps(summary['environment'])}")

    model_cfg = cfg["model"]
    if "path" in model_cfg:  # an operator's own checkpoint (SmolLM2, say) where its weights are at hand
        model = Path(model_cfg["path"])
    else:
        model = random_model(
            model_cfg["family"], model_cfg["shape"], _tokenizer_dir(), logs / "model", model_cfg.get("seed", 0)
        )
    tok = tokenizer(str(model))
    questions, load = _questions(cfg, tok), _long_load(cfg, tok)
    lc = cfg["long_context"]
    budget = int(lc["kv_budget"] * lc["requests"] * (lc["prompt_tokens"] + lc["max_tokens"]))
    longest = max(len(tok.encode(q.prompt)) + q.max_tokens for q in [*questions, *load])
    if budget < longest + 64:  # SGLang refuses a request longer than its pool (64: a chat template's tokens)
        raise ValueError(f"a device KV budget of {budget} tokens cannot hold a {longest}-token request: fix the config")
    args = ("--dtype", cfg["dtype"], "--max-total-tokens", str(budget), *cfg["server_args"])
    summary["kv_budget_tokens"] = budget
    deadline = t_start + 60 * cfg["minutes"]
    reference: dict[str, list[Answer]] = {}
    write = partial(_write, out, stem, summary)

    with ExitStack() as stack:
        try:  # a store that does not start costs the store row only
            store_url, store_error = stack.enter_context(store_server(logs)), None
        except Exception as e:
            store_url, store_error = "", f"the store server did not start: {type(e).__name__}: {e}"
        for name in cfg["servers"]:
            if time.monotonic() > deadline - cfg["server_minutes"] * 60:
                summary["rows"].append({"server": name, "skipped": "out of time"})
                log(f"  {name}: skipped, out of time")
                continue
            if name == "store" and store_error:
                summary["rows"].append({"server": name, "error": store_error})
                continue
            vericache = None if name == "stock" else _vericache_config(cfg, name, store_url)
            try:
                row = _measure(name, vericache, questions, load, reference, logs, platform, str(model), args, cfg)
            except Exception as e:  # the next server still runs; the row says why this one did not
                row = {"server": name, "error": f"{type(e).__name__}: {e}"[:4000]}
            summary["rows"].append(row)
            log(f"  {name}: {json.dumps({k: v for k, v in row.items() if not k.startswith('_')})}")
            write()
    rows = [r for r in summary["rows"] if "identical" in r]
    summary["identical"] = bool(rows) and all(r["identical"] == r["requests"] for r in rows)
    summary["seconds"] = round(time.monotonic() - t_start, 1)
    write()
    return summary


def _measure(
    name: str,
    vericache: dict | None,
    questions: list[Ask],
    load: list[Ask],
    reference: dict[str, list[Answer]],
    logs: Path,
    platform: Platform,
    model: str,
    args: tuple[str, ...],
    cfg: dict,
) -> dict:
    t0 = time.monotonic()
    server = SGLangServer(
        logs,
        name,
        *args,
        vericache=vericache,
        platform=platform,
        model=model,
        start_timeout=cfg["start_timeout_s"],
    )
    try:
        started = time.monotonic() - t0
        before = server.metrics()
        exact = [ask(server, q) for q in questions]
        result = run_load(server, load)
        after = server.metrics()
        backends = server.labelled("vericache_target_verify_forwards_total", "backend") if vericache else {}
    finally:
        server.stop()
    tokens = sum(a.completion_tokens or 0 for a in result.answers)
    row: dict[str, Any] = {
        "server": name,
        "start_s": round(started, 1),
        "tokens_per_s": tokens / result.seconds,
        "load_s": round(result.seconds, 2),
        "peak_kv_tokens": int(result.peak_tokens),
        "mean_accepted_length": accepted_length(after, before) if vericache else None,
        "full_kv_fetched_mib": metric_growth(after, before, "vericache_full_kv_fetched_bytes_total") / 2**20,
        "verify_backends": ",".join(sorted(backends)) or None,
        "requests": len(questions) + len(load),
    }
    if name == "stock":
        reference["exact"], reference["load"] = exact, result.answers
        row["identical"], row["max_logprob_diff"] = row["requests"], 0.0
    else:
        same_exact, diff = _compare(reference["exact"], exact)
        same_load, _ = _compare(reference["load"], result.answers)
        row["identical"], row["max_logprob_diff"] = same_exact + same_load, diff
    return row


def _write(out: Path, stem: str, summary: dict) -> None:
    (out / f"{stem}.json").write_text(json.dumps(summary, indent=2))
    rows = summary["rows"]
    stock = next((r for r in rows if r["server"] == "stock" and "tokens_per_s" in r), None)
    for r in rows:
        if stock and "tokens_per_s" in r:
            r["vs_stock"] = r["tokens_per_s"] / stock["tokens_per_s"]
            r["kv_vs_stock"] = r["peak_kv_tokens"] / max(stock["peak_kv_tokens"], 1)
    cols = [
        "server",
        "identical",
        "requests",
        "max_logprob_diff",
        "tokens_per_s",
        "vs_stock",
        "peak_kv_tokens",
        "kv_vs_stock",
        "mean_accepted_length",
        "full_kv_fetched_mib",
        "verify_backends",
        "start_s",
        "load_s",
        "error",
        "skipped",
    ]
    (out / f"{stem}.md").write_text(
        "# SGLang GPU check: stock against VeriCache\n\n"
        f"Environment: `{json.dumps(summary.get('environment'))}`\n\n"
        f"Device KV budget: {summary.get('kv_budget_tokens')} tokens (a quarter of the long-context load's full KV)."
        f" Config: `{json.dumps(summary['config'])}`\n\n{table(rows, cols)}\n"
    )
