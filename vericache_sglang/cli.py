"""``vericache``: generate, serve, prefix, compressors, bench, model (the clients: ``serve.client_commands``)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import signal
import sys
import time
from pathlib import Path

from vericache_sglang.core.compress import SpecError
from vericache_sglang.serve.client_commands import add_client_commands


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="decode one prompt with VeriCache (and optionally the baselines)")
    p.add_argument("--model", default="smollm2", help="'smollm2' (default), 'tiny', or a local HF model dir")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="the user message (the chat template is applied)")
    src.add_argument("--prompt-file", type=Path, help="a file holding the user message")
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--compressor", default="snapkv:ratio=0.25", help="compressor spec, e.g. kivi:bits=2")
    p.add_argument(
        "--horizon", type=int, default=16, help="drafted tokens per verification (x); with --adaptive-horizon, the most"
    )
    p.add_argument(
        "--adaptive-horizon",
        action="store_true",
        help="choose each window's length from the acceptance so far and the measured costs",
    )
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--verify",
        choices=("exact", "rejection"),
        default="exact",
        help="sampling acceptance: exact (identical to full-KV sampling with the same seed) or "
        "speculative rejection sampling (lossless in distribution)",
    )
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument(
        "--response-format",
        help="a grammar every token follows: an OpenAI response_format as JSON "
        '(json_object, json_schema; or {"type": "regex"|"ebnf", ...}) '
        "or @FILE holding one",
    )
    p.add_argument("--logprobs", action="store_true", help="report the verifier's logprob of each token")
    p.add_argument(
        "--store",
        default="memory://",
        help="full-KV store URL: memory:// (default), redis[s]://, grpc[s]://; add "
        "?link_ratio=R or ?link_gbps=G to emulate a link",
    )
    p.add_argument("--store-namespace", default="default", help="tenant salt of the store keys")
    p.add_argument("--on-store-error", choices=("recompute", "fail"), default="recompute")
    p.add_argument("--check", action="store_true", help="also run full-KV decoding; report identity")
    p.add_argument("--lossy", action="store_true", help="also run lossy decoding with the compressed KV alone")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    p.add_argument(
        "--batch-invariant",
        choices=("auto", "on", "off"),
        default="auto",
        help="compute every verified row as a one-token decode step would (auto: on a GPU)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    p.set_defaults(func=cmd_generate)


def cmd_generate(args: argparse.Namespace) -> int:
    import torch

    from vericache_sglang.core.compress import parse_spec
    from vericache_sglang.core.sampling import SamplingParams
    from vericache_sglang.engine.decode import GenerationConfig
    from vericache_sglang.engine.engine import Engine, compare
    from vericache_sglang.engine.report import repetition, summary_lines

    if args.threads:
        torch.set_num_threads(args.threads)
    # Bad arguments fail before the model loads.
    compressor = parse_spec(args.compressor)
    sampling = SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)
    GenerationConfig(max_new_tokens=args.max_new_tokens, horizon=args.horizon)
    prompt = args.prompt if args.prompt is not None else args.prompt_file.read_text()
    progress = not args.quiet
    engine = Engine(
        args.model,
        store=args.store,
        device=args.device,
        dtype=getattr(torch, args.dtype),
        namespace=args.store_namespace,
        progress=progress,
        batch_invariant={"auto": None, "on": True, "off": False}[args.batch_invariant],
    )
    tokens = engine.encode(prompt, chat=not args.raw)
    constraint = None
    if args.response_format:
        text = args.response_format
        text = Path(text[1:]).read_text() if text.startswith("@") else text
        try:
            constraint = engine.constraint(json.loads(text))
        except json.JSONDecodeError as e:
            raise ValueError(f"--response-format is not JSON: {e}") from None
    cfg = engine.config(
        max_new_tokens=args.max_new_tokens,
        sampling=sampling,
        stop_strings=tuple(args.stop),
        horizon=args.horizon,
        adaptive_horizon=args.adaptive_horizon,
        verify=args.verify,
        logprobs=args.logprobs,
        keep_logits=args.check,
        on_store_error=args.on_store_error,
        constraint=constraint,
    )
    pre = engine.prefill(tokens)
    result = engine.generate(pre, "vericache", compressor, cfg)
    report: dict[str, object] = {
        "model": engine.loaded.model_id,
        "compressor": compressor.spec,
        "horizon": args.horizon,
        "prompt_tokens": len(tokens),
        "prefix_tokens_reused": pre.reused_tokens,
        "prefill_s": round(pre.seconds, 3),
        "identical": None,
        "max_logit_abs_diff": None,
        "generated_tokens": len(result.tokens),
        "finish_reason": result.finish_reason,
        "mean_accepted_length": round(result.stats.mean_accepted_length, 3),
        "acceptance_rate": round(result.stats.acceptance_rate, 4),
        "verify_passes": result.stats.verify_passes,
        "tokens_per_second": round(result.tokens_per_second, 3),
        "full_kv_bytes": result.stats.full_kv_bytes,
        "compressed_kv_bytes": result.stats.compressed_kv_bytes,
        "fetch_bytes_per_verify": (
            round(sum(result.stats.fetch_bytes) / len(result.stats.fetch_bytes)) if result.stats.fetch_bytes else 0
        ),
        "fetch_wait_s": round(result.stats.fetch_wait_s, 3),
        "store_fallbacks": result.stats.store_fallbacks,
        "store": engine.store_report(),
        "repetition": round(repetition(result.tokens), 4),
        "text": result.text,
    }
    if args.logprobs:
        report["logprobs"] = result.logprobs
    if args.check:
        full = engine.generate(pre, "full", cfg=cfg)
        cmp = compare(full, result)
        report.update(
            identical=cmp["identical"],
            first_mismatch=cmp["first_mismatch"],
            max_logit_abs_diff=cmp["max_logit_abs_diff"],
        )
        report["full"] = {"tokens_per_second": round(full.tokens_per_second, 3), "text": full.text}
    if args.lossy:
        lossy = engine.generate(pre, "lossy", compressor, cfg)
        entry: dict[str, object] = {"tokens_per_second": round(lossy.tokens_per_second, 3), "text": lossy.text}
        if args.check:
            cmp = compare(full, lossy)
            entry.update(identical=cmp["identical"], first_mismatch=cmp["first_mismatch"])
        report["lossy"] = entry
    if args.json:
        print(json.dumps(report))
    else:
        print("\n".join(summary_lines(report)))
    return 0 if report["identical"] in (None, True) else 1


def cmd_compressors(args: argparse.Namespace) -> int:
    from vericache_sglang.core.compress import MODIFIER_SUMMARIES, MODIFIERS, RECOMMENDED, describe_compressors

    if args.recommended:
        print(RECOMMENDED)  # alone on stdout: --compressor "$(vericache compressors --recommended)"
        return 0
    table = describe_compressors()
    if args.json:
        print(json.dumps(table, indent=2))
        return 0
    for c in table:
        params = ", ".join(f"{k}={v['default']}" for k, v in c["parameters"].items())
        print(f"{c['name']:<20} {c['kind']:<13} {params}\n{'':<20} {c['summary']}")
    print("\ncompose a dropper and a quantizer with '+', e.g. snapkv:ratio=0.25+kivi:bits=4")
    print("\ndrafting modifiers, after the compressor with '+', in this order:")
    for name, params in MODIFIERS.items():
        defaults = ", ".join(f"{f.name}={f.default}" for f in dataclasses.fields(params))
        print(f"{name:<20} {'modifier':<13} {defaults}\n{'':<20} {MODIFIER_SUMMARIES[name]}")
    print(f"\nrecommended (README): {RECOMMENDED}")
    return 0


def cmd_model(args: argparse.Namespace) -> int:
    from vericache_sglang.engine.model import load_model, prepare_smollm2

    t = time.monotonic()
    path = prepare_smollm2(progress=True)
    loaded = load_model("smollm2", progress=False)
    print(f"{loaded.model_id} ready (loaded in {time.monotonic() - t:.1f} s)", file=sys.stderr)
    print(path)  # alone on stdout: --model-path "$(vericache model)"
    return 0


BENCH_MODULES = {
    "sglang": "sglang_cpu",
    "sglang-prefix": "sglang_prefix",
    "sglang-gpu": "sglang_gpu",
    "steps": "step_cost",
}


def cmd_bench(args: argparse.Namespace) -> int:
    import importlib

    from vericache_sglang.bench.common import RESULTS

    module = importlib.import_module(f"vericache_sglang.bench.{BENCH_MODULES.get(args.which, args.which)}")
    # progress goes to stderr in both forms: a long run is never silent, and --json keeps stdout clean
    summary = module.run(args.config, args.quick, args.out or RESULTS, log=lambda s: print(s, file=sys.stderr))
    print(json.dumps(summary) if args.json else json.dumps(summary, indent=2))
    return 0 if summary.get("identical", True) else 1


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="an OpenAI-compatible server (/v1/completions, /v1/chat/completions, /metrics)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--model", default="smollm2", help="'smollm2' (default), 'tiny', or a local HF model dir")
    p.add_argument("--served-model-name", help="the model name clients use (default: the model's)")
    p.add_argument(
        "--compressor",
        default="snapkv:ratio=0.25",
        help="default compressor spec (per request: the 'vericache' object's 'compressor')",
    )
    p.add_argument("--horizon", type=int, default=16, help="default draft horizon")
    p.add_argument("--store", default="memory://", help="full-KV store URL (as for generate)")
    p.add_argument("--store-namespace", default="default")
    p.add_argument("--kv-budget-bytes", type=int, default=4 << 30, help="device bytes for compressed KV and reloads")
    p.add_argument("--max-prompt-tokens", type=int, default=8192)
    p.add_argument("--max-tokens", type=int, default=2048, help="the most a request may ask for")
    p.add_argument("--max-concurrency", type=int, default=16, help="requests in flight; more get HTTP 429")
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=8 << 20,
        help="a request body larger than this gets HTTP 413 before it is parsed",
    )
    p.add_argument("--api-key-file", type=Path, help="require 'Authorization: Bearer <key>' (key read from file)")
    p.add_argument(
        "--prefix-compressor",
        default="kvzip:ratio=0.25",
        help="compressor of shared documents' copies ('none': no shared documents); it never sees "
        "the question, so query-agnostic ones suit it (kvzip, knorm, streamingllm, quantizers)",
    )
    p.add_argument("--prefix-refresh-s", type=float, default=2.0, help="how often to read the store's catalog")
    p.add_argument("--max-prefix-bytes", type=int, default=1 << 30, help="compressed document copies held")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    p.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    import torch
    import uvicorn

    from vericache_sglang.core.compress import parse_spec
    from vericache_sglang.engine.engine import Engine
    from vericache_sglang.engine.prefix import PrefixRegistry
    from vericache_sglang.serve.openai_api import create_app
    from vericache_sglang.serve.service import EngineService, Limits

    parse_spec(args.compressor)  # bad specs fail before the model loads
    prefix_compressor = None if args.prefix_compressor == "none" else parse_spec(args.prefix_compressor)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    api_key = args.api_key_file.read_text().strip() if args.api_key_file else None
    if args.api_key_file and not api_key:
        raise ValueError(f"{args.api_key_file} is empty")
    if args.threads:
        torch.set_num_threads(args.threads)
    engine = Engine(
        args.model,
        store=args.store,
        device=args.device,
        dtype=getattr(torch, args.dtype),
        namespace=args.store_namespace,
    )
    limits = Limits(
        max_prompt_tokens=args.max_prompt_tokens, max_new_tokens=args.max_tokens, max_concurrency=args.max_concurrency
    )
    prefixes = (
        None
        if prefix_compressor is None
        else PrefixRegistry(engine.runner, engine.store, prefix_compressor, args.max_prefix_bytes)
    )
    service = EngineService(
        engine,
        args.compressor,
        args.horizon,
        args.kv_budget_bytes,
        limits,
        prefixes=prefixes,
        prefix_refresh_s=args.prefix_refresh_s,
    )
    service.start()
    name = args.served_model_name or engine.loaded.name
    # uvicorn shuts down gracefully on SIGTERM/SIGINT, then re-raises the signal to the handler it
    # found: with this one (which ignores it) the process stops the engine and exits 0 instead of
    # dying by the signal.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda _signum, _frame: None)
    try:
        uvicorn.run(
            create_app(service, name, api_key, args.max_body_bytes),
            host=args.host,
            port=args.port,
            log_level=args.log_level,
        )
    finally:
        service.stop()
    return 0


def _add_prefix(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "prefix", help="shared documents (RAG): register once, every server sharing the store drafts over them at once"
    )
    psub = p.add_subparsers(dest="action", required=True)
    add = psub.add_parser("add", help="register a document: its full KV into the store, listed in its catalog")
    add.add_argument("file", type=Path, help="the document's text ('-': standard input)")
    add.add_argument("--name", help="a name to list it under (default: from its digest)")
    add.add_argument(
        "--role",
        default="system",
        choices=("system", "user", "raw"),
        help="the chat-template segment it is rendered as (requests must send it the same way)",
    )
    lst = psub.add_parser("list", help="the documents in the store's catalog, or a server's copies")
    rm = psub.add_parser("remove", help="unlist a document (servers drop their copies at their next sync)")
    rm.add_argument("digest")
    for q in (add, lst, rm):
        where = q.add_mutually_exclusive_group(required=True)
        where.add_argument("--server", help="a running 'vericache serve' (http://HOST:PORT): it does the work")
        where.add_argument("--store", help="the full-KV store URL: this process does the work (add loads the model)")
        q.add_argument("--model", default="smollm2", help="with --store: the model (its layout names the keys)")
        q.add_argument("--store-namespace", default="default")
        q.add_argument("--api-key-file", type=Path, help="with --server: its API key")
        q.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_prefix)


def cmd_prefix(args: argparse.Namespace) -> int:
    if args.server:
        return _prefix_via_server(args)
    from vericache_sglang.full_kv.documents import DocumentCatalog

    if args.action in ("list", "remove"):
        # the catalog is read and written by key: the model's layout names them, its weights are not needed
        from remote_store import connect_store
        from vericache_sglang.engine.hardware import memory_bandwidth
        from vericache_sglang.engine.model import model_layout
        from vericache_sglang.full_kv.store import FullKVStore

        backend = connect_store(args.store, memory_bandwidth=lambda: memory_bandwidth("cpu"))
        catalog = DocumentCatalog(FullKVStore(backend, model_layout(args.model), args.store_namespace))
        if args.action == "remove":
            if not catalog.remove(args.digest):
                print(f"vericache: error: no document {args.digest} is listed", file=sys.stderr)
                return 1
            print(f"removed {args.digest}")
            return 0
        docs = [d.to_json() for d in catalog.documents()]
        print(
            json.dumps(docs) if args.json else "\n".join(f"{d['digest']}  {d['tokens']:>7}  {d['name']}" for d in docs)
        )
        return 0
    from vericache_sglang.engine.engine import Engine
    from vericache_sglang.engine.prefix import document_tokens, store_document

    engine = Engine(args.model, store=args.store, namespace=args.store_namespace)
    text = sys.stdin.read() if str(args.file) == "-" else args.file.read_text()
    tokens = document_tokens(engine.tokenizer, text, args.role)
    t = time.monotonic()
    pre, digest, name = store_document(engine.runner, engine.store, tokens, args.name)
    report = {
        "digest": digest,
        "name": name,
        "tokens": len(pre.tokens),
        "submitted_tokens": len(tokens),
        "full_kv_bytes": pre.kv.nbytes,
        "seconds": round(time.monotonic() - t, 3),
    }
    print(
        json.dumps(report)
        if args.json
        else f"registered {name} ({digest}): {len(pre.tokens)} of "
        f"{len(tokens)} tokens (whole store chunks), full KV {pre.kv.nbytes / 2**20:.1f} MiB"
    )
    return 0


def _prefix_via_server(args: argparse.Namespace) -> int:
    import httpx

    headers = {}
    if args.api_key_file:
        headers["Authorization"] = f"Bearer {args.api_key_file.read_text().strip()}"
    url = args.server.rstrip("/") + "/v1/prefixes"
    if args.action == "list":
        r = httpx.get(url, headers=headers, timeout=30)
    elif args.action == "remove":
        r = httpx.delete(f"{url}/{args.digest}", headers=headers, timeout=60)
    else:
        text = sys.stdin.read() if str(args.file) == "-" else args.file.read_text()
        r = httpx.post(url, json={"text": text, "role": args.role, "name": args.name}, headers=headers, timeout=600)
    if r.status_code != 200:
        print(f"vericache: error: {args.server} answered {r.status_code}: {r.text}", file=sys.stderr)
        return 2
    body = r.json()
    if args.json:
        print(json.dumps(body))
    elif args.action == "remove":
        print(f"removed {args.digest}")
    elif args.action == "list":
        for d in body["data"]:
            print(f"{d['digest']}  {d['tokens']:>7}  {d['name']}  ({d['compressor']}, {d['hits']} hits)")
    else:
        print(
            f"registered {body['name']} ({body['digest']}): {body['tokens']} of {body['submitted_tokens']} tokens, "
            f"compressed copy {body['compressed_kv_bytes'] / 2**20:.2f} MiB ({body['compressor']})"
        )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vericache", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_serve(sub)
    _add_prefix(sub)
    add_client_commands(sub)
    p = sub.add_parser("compressors", help="list the compressors, their parameters and defaults")
    p.add_argument("--json", action="store_true")
    p.add_argument(
        "--recommended", action="store_true", help="print only the spec of the configuration the README recommends"
    )
    p.set_defaults(func=cmd_compressors)
    p = sub.add_parser(
        "bench",
        help="run a benchmark: longctx (long-context decoding), prefix (remote prefixes), "
        "sglang (stock SGLang against VeriCache servers on this CPU), sglang-prefix (a "
        "document's prefix across two SGLang servers), sglang-gpu (the one-shot GPU check; --quick: its "
        "dry run on this CPU) or steps (the "
        "cost of one batched iteration against the bytes it reads)",
    )
    p.add_argument("which", choices=("longctx", "prefix", "sglang", "sglang-prefix", "sglang-gpu", "steps"))
    p.add_argument("--quick", action="store_true", help="the small configuration CI runs")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument("--config", type=Path, help="config file (default: benchmarks/configs/WHICH.json)")
    p.add_argument("--out", type=Path, help="results folder (default: benchmarks/results)")
    p.set_defaults(func=cmd_bench)
    p = sub.add_parser("model", help="prepare the default model's safetensors cache (SmolLM2-135M-Instruct)")
    p.set_defaults(func=cmd_model)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from remote_store import StoreError
    from vericache_sglang.engine.model import ModelError

    try:
        return args.func(args)
    except (SpecError, ModelError, StoreError, ValueError, OSError, RuntimeError) as e:
        print(f"vericache: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
