"""One GPU script for the whole project, for the short GPU leases some sessions get.

The lent machine has Python 3.12, torch, transformers and triton but no sglang and nothing
installable, and the real model does not travel (64 MiB per call), so this runs the project from
source (PYTHONPATH=repo) on a seeded random model of a real shape. It measures what a CPU cannot:

1. device memory bandwidth and the host<->device link (pinned copies): the real bandwidth ratio;
2. decode-step time of the runner against batch size, with the full KV and with a compressed KV
   (SnapKV keeping 1/8), and the verify pass for x+1 tokens;
3. the Triton dequantization kernel against its torch reference;
4. every compressor's VeriCache output against full-KV greedy decoding on the device (float32 and
   bfloat16, a seeded random Llama);
5. a VeriCache throughput model (the paper's Eq. 3) from those measurements, with the acceptance
   lengths REPLAYED from a CPU run (benchmarks/results/matrix.json), labelled as such.

Every section is time-boxed; results go to --out ($OUT on the device machine) as JSON and
markdown. ``--device cpu --quick`` runs every section on tiny shapes (CI checks it that way).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SHAPES = {
    # real model shapes with fewer layers (the per-layer costs scale; the result is per layer too)
    "llama3-8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        layers=8,
    ),
    "qwen2.5-32b": dict(
        hidden_size=5120,
        intermediate_size=27648,
        num_attention_heads=40,
        num_key_value_heads=8,
        vocab_size=152064,
        layers=4,
    ),
    "tiny": dict(
        hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=512, layers=2
    ),
}


def timed(fn, device: str, repeats: int = 5) -> float:
    import torch

    fn()
    if device != "cpu":
        torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        if device != "cpu":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def section_bandwidth(device: str, quick: bool) -> dict:
    import torch

    from vericache_sglang.engine.hardware import streaming_read_bandwidth

    n = (16 << 20) if quick else (1 << 30)
    probe = streaming_read_bandwidth(device, n)
    out = {"memory_bytes_s": probe.bytes_s, "memory_probe": probe.describe()}
    if device != "cpu":
        host = torch.empty(n // 4, dtype=torch.float32).pin_memory()
        dev = torch.empty(n // 4, dtype=torch.float32, device=device)
        out["h2d_bytes_s"] = n / timed(lambda: dev.copy_(host, non_blocking=True), device)
        out["d2h_bytes_s"] = n / timed(lambda: host.copy_(dev, non_blocking=True), device)
        out["memory_over_h2d_ratio"] = out["memory_bytes_s"] / out["h2d_bytes_s"]
    return out


def build_runner(shape: str, device: str, dtype):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from vericache_sglang.engine.model import LoadedModel
    from vericache_sglang.engine.runner import ModelRunner

    s = dict(SHAPES[shape])
    layers = s.pop("layers")
    config = LlamaConfig(**s, num_hidden_layers=layers, max_position_embeddings=131072, rope_theta=500000.0)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype).eval()
    return ModelRunner(LoadedModel(model, None, f"random-{shape}", f"random-{shape}@seed0", None))


def section_decode(shape: str, device: str, dtype_name: str, quick: bool, deadline: float) -> dict:
    import torch

    from vericache_sglang.core.compress import Observation, parse_spec
    from vericache_sglang.engine.runner import DraftKV, ResidentKV, Segment

    dtype = getattr(torch, dtype_name)
    runner = build_runner(shape, device, dtype)
    lay = runner.layout
    context = 512 if quick else 16384
    batches = [1, 2] if quick else [1, 4, 16, 32]
    horizon = 16
    rows = []
    g = torch.Generator(device="cpu").manual_seed(1)
    kv = [
        (
            torch.randn(lay.num_kv_heads, context, lay.head_dim, generator=g).to(device, dtype),
            torch.randn(lay.num_kv_heads, context, lay.head_dim, generator=g).to(device, dtype),
        )
        for _ in range(lay.num_layers)
    ]
    from vericache_sglang.core.kv import FullKV

    full = FullKV(lay, kv)
    obs = Observation(
        [torch.randn(runner.num_heads, 64, lay.head_dim, generator=g).to(device, dtype) for _ in range(lay.num_layers)]
    )
    ckv = parse_spec("snapkv:ratio=0.125").compress(full, obs)
    for b in batches:
        if time.monotonic() > deadline:
            break
        resident = [ResidentKV.from_full(full, context + 64, device) for _ in range(b)]

        def full_step(resident=resident):
            runner.forward([Segment([1], [context], r, logits="last") for r in resident])
            for r in resident:
                r.truncate(context)

        ckvs = [ckv.clone() for _ in range(b)]  # each request its own (a window drafts in its KV's room)

        def draft_step(ckvs=ckvs):
            runner.forward([Segment([1], [context], DraftKV(c), logits="last") for c in ckvs])

        def verify_pass():
            ctx = [ResidentKV.from_full(full, context + horizon + 1, device) for _ in range(1)]
            runner.forward([Segment([1] * (horizon + 1), list(range(context, context + horizon + 1)), ctx[0])])

        rows.append(
            {
                "batch": b,
                "context": context,
                "full_decode_step_s": timed(full_step, device),
                "compressed_draft_step_s": timed(draft_step, device),
                "verify_pass_s": timed(verify_pass, device, repeats=3),
            }
        )
    return {
        "shape": shape,
        "dtype": dtype_name,
        "layers_run": lay.num_layers,
        "full_kv_bytes_per_request": full.nbytes,
        "compressed_kv_bytes_per_request": ckv.nbytes,
        "rows": rows,
    }


def section_kernels(device: str, quick: bool) -> dict:
    import torch

    from vericache_sglang.core.compress.quant.quant import dequantize, pack, quantize
    from vericache_sglang.kernels.dequant import dequantize_packed

    n = 256 if quick else 65536
    x = torch.randn(8, n, 128, device=device)
    codes, scale, mn = quantize(x.view(8, n, 4, 32), dim=3, bits=2)
    packed = pack(codes.view(8, n, 128), 2)
    ref = dequantize(codes, scale, mn, torch.float32).view(8, n, 128)
    got = dequantize_packed(packed, scale, mn, 2, col_group=32)
    out = {"equal_to_reference": bool(torch.equal(got, ref)), "elements": x.numel()}
    if device != "cpu":
        out["triton_s"] = timed(lambda: dequantize_packed(packed, scale, mn, 2, col_group=32), device)
        out["torch_reference_s"] = timed(lambda: dequantize(codes, scale, mn, torch.float32), device)
    return out


# Every compressor on the device (kvzip needs a tokenizer, which a random model has not).
DEVICE_SPECS = [
    "streamingllm:window=128",
    "h2o",
    "snapkv",
    "pyramidkv",
    "adakv",
    "expected_attention",
    "tova",
    "knorm",
    "quest",
    "kivi:bits=2",
    "int8",
    "int4",
    "kvquant",
    "rotatekv",
    "snapkv:ratio=0.25+kivi:bits=4",
]


# (dtype, row_bucket, row_attention, specs): float32 as it is, then bfloat16 plain and with the
# runner's batch-invariance options (see ModelRunner), to find what low precision needs.
CHECK_SHORT = ["snapkv", "kivi:bits=2", "int8", "quest"]
VARIANTS = {
    "fp32": ("float32", 0, False, DEVICE_SPECS),
    "bf16": ("bfloat16", 0, False, CHECK_SHORT),
    "bf16-rows": ("bfloat16", 64, False, CHECK_SHORT),
    "bf16-invariant": ("bfloat16", 64, True, DEVICE_SPECS),
}


def section_compressors(
    device: str, quick: bool, deadline: float, variants: list[str] | None = None, specs: list[str] | None = None
) -> dict:
    """VeriCache against full-KV greedy decoding on the device for every compressor, on a seeded
    random Llama (weights spread wide enough that argmax is rarely a near-tie)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from remote_store.backends.memory import MemoryStore
    from vericache_sglang.core.compress import parse_spec
    from vericache_sglang.engine.decode import GenerationConfig, generate_full, generate_vericache
    from vericache_sglang.engine.engine import compare
    from vericache_sglang.engine.model import LoadedModel
    from vericache_sglang.engine.prefill import prefill
    from vericache_sglang.engine.runner import ModelRunner
    from vericache_sglang.full_kv.store import FullKVStore

    rows = []
    for key in variants or list(VARIANTS):
        dtype_name, bucket, row_attention, default_specs = VARIANTS[key]
        dtype = getattr(torch, dtype_name)
        config = LlamaConfig(
            vocab_size=4096,
            hidden_size=512,
            intermediate_size=1024,
            num_hidden_layers=2 if quick else 4,
            num_attention_heads=8,
            num_key_value_heads=2,
            max_position_embeddings=8192,
            initializer_range=0.2,
            tie_word_embeddings=False,
        )
        torch.manual_seed(0)
        with torch.device(device):
            model = LlamaForCausalLM(config).to(dtype).eval()
        name = f"random-gpu-check-{dtype_name}"
        runner = ModelRunner(
            LoadedModel(model, None, name, name + "@seed0", None), row_bucket=bucket, row_attention=row_attention
        )
        n = 256 if quick else 1536
        prompt = torch.randint(0, 4096, (n,), generator=torch.Generator().manual_seed(1)).tolist()
        pre = prefill(runner, prompt)
        cfg = GenerationConfig(max_new_tokens=16 if quick else 48, horizon=8, keep_logits=True)
        ref = generate_full(runner, pre, cfg)
        variant = {"dtype": dtype_name, "row_bucket": bucket, "row_attention": row_attention}
        for spec in specs or default_specs:
            if time.monotonic() > deadline:
                rows.append({**variant, "compressor": spec, "skipped": "out of time"})
                continue
            try:
                store = FullKVStore(MemoryStore(), runner.layout, chunk_tokens=64)
                res = generate_vericache(runner, pre, parse_spec(spec), store, cfg)
                cmp = compare(ref, res)
                rows.append(
                    {
                        **variant,
                        "compressor": spec,
                        "identical": cmp["identical"],
                        "first_mismatch": cmp["first_mismatch"],
                        "max_logit_abs_diff": cmp["max_logit_abs_diff"],
                        "mean_accepted_length": res.stats.mean_accepted_length,
                    }
                )
            except Exception as e:  # one compressor's failure is a result; the others still run
                rows.append({**variant, "compressor": spec, "error": f"{type(e).__name__}: {e}"})
    return {"label": "seeded random Llama on the device; exactness of VeriCache vs full-KV greedy", "rows": rows}


def replayed_acceptance(path: Path) -> dict:
    """Mean accepted length per compressor at x=16 (greedy), from a CPU exactness-matrix run."""
    if not path.is_file():
        return {}
    rows = json.loads(path.read_text())
    out: dict[str, list[float]] = {}
    for r in rows:
        if r["mode"] == "greedy" and r["horizon"] == 16:
            out.setdefault(r["compressor"], []).append(r["mean_accepted_length"])
    return {k: sum(v) / len(v) for k, v in out.items()}


def section_model(bandwidth: dict, decode: dict, acceptance: dict) -> dict:
    """Eq. 3: T_iter = max(T_gpu, T_xfer); tokens per request-iteration = committed/(x+1)."""
    if not decode.get("rows") or "h2d_bytes_s" not in bandwidth:
        return {"note": "needs a GPU run (h2d bandwidth) and decode timings"}
    x = 16
    full_bytes = decode["full_kv_bytes_per_request"]
    out = []
    for r in decode["rows"]:
        b = r["batch"]
        for spec, accepted in acceptance.items():
            t_gpu = r["compressed_draft_step_s"] + r["verify_pass_s"] * b / (x + 1)
            t_xfer = (b / (x + 1)) * full_bytes / bandwidth["h2d_bytes_s"]
            t_iter = max(t_gpu, t_xfer)
            out.append(
                {
                    "batch": b,
                    "compressor": spec,
                    "replayed_accepted_length": accepted,
                    "vericache_tok_s": b * (accepted / (x + 1)) / t_iter,
                    "full_resident_tok_s": b / r["full_decode_step_s"],
                    "link_bound": t_xfer > t_gpu,
                }
            )
    return {"label": "MODEL: acceptance replayed from a CPU run (SmolLM2), timings measured here", "rows": out}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu_bench_out")))
    p.add_argument("--device", default="cuda")
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    p.add_argument("--minutes", type=float, default=5.0, help="the whole run's time box")
    p.add_argument("--quick", action="store_true", help="tiny shapes (the CPU check of this script)")
    p.add_argument(
        "--sections",
        default="bandwidth,kernels,compressors,decode",
        help="comma-separated sections to run (default: all)",
    )
    p.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help=f"compressors section: comma-separated runner variants of {', '.join(VARIANTS)}",
    )
    p.add_argument("--specs", default="", help="compressors section: ';'-separated specs (default: each variant's)")
    p.add_argument("--acceptance", type=Path, default=REPO / "benchmarks" / "results" / "matrix.json")
    args = p.parse_args(argv)
    if args.minutes <= 0:
        p.error("--minutes must be > 0")
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu_bench: no CUDA device here; use --device cpu --quick to check the script", file=sys.stderr)
        return 2
    deadline = time.monotonic() + 60 * args.minutes
    shape = "tiny" if args.quick else args.shape
    results: dict = {
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if args.device != "cpu" else "cpu",
        "shape": shape,
        "quick": args.quick,
        "errors": {},
    }
    # The short sections first; the decode sweep takes what time is left.
    sections = [
        ("bandwidth", lambda: section_bandwidth(args.device, args.quick)),
        ("kernels", lambda: section_kernels(args.device, args.quick)),
        (
            "compressors",
            lambda: section_compressors(
                args.device, args.quick, deadline, variants, [x for x in args.specs.split(";") if x] or None
            ),
        ),
        (
            "decode",
            lambda: section_decode(
                shape, args.device, args.dtype if args.device != "cpu" else "float32", args.quick, deadline
            ),
        ),
    ]
    variants = args.variants.split(",")
    if set(variants) - set(VARIANTS):
        p.error(f"unknown variants: {', '.join(sorted(set(variants) - set(VARIANTS)))}")
    wanted = set(args.sections.split(","))
    unknown = wanted - {name for name, _ in sections}
    if unknown:
        p.error(f"unknown sections: {', '.join(sorted(unknown))}")
    for name, fn in sections:
        if name not in wanted:
            continue
        if time.monotonic() > deadline:
            results["errors"][name] = "skipped: out of time"
            continue
        t = time.monotonic()
        try:
            results[name] = fn()
        except Exception as e:  # a section's failure is a result, the others still run
            results["errors"][name] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}"
        results.setdefault("seconds", {})[name] = time.monotonic() - t
    results["acceptance_replayed"] = replayed_acceptance(args.acceptance)
    results["model"] = section_model(
        results.get("bandwidth", {}), results.get("decode", {}), results["acceptance_replayed"]
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_bench.json").write_text(json.dumps(results, indent=2, default=str))
    lines = [f"# gpu_bench on {results['device']} ({shape}, torch {torch.__version__})", ""]
    for k, v in results.get("bandwidth", {}).items():
        if isinstance(v, str):
            lines.append(f"- {k}: {v}")
        else:
            lines.append(f"- {k}: {v / 1e9:.1f} GB/s" if k.endswith("bytes_s") else f"- {k}: {v:.1f}")
    for r in results.get("decode", {}).get("rows", []):
        lines.append(
            f"- batch {r['batch']}, context {r['context']}: full step {1e3 * r['full_decode_step_s']:.2f} ms, "
            f"compressed draft step {1e3 * r['compressed_draft_step_s']:.2f} ms, "
            f"verify x+1 {1e3 * r['verify_pass_s']:.2f} ms"
        )
    for r in results.get("compressors", {}).get("rows", []):
        what = (
            f"identical={r['identical']} max|dlogit|={r['max_logit_abs_diff']:.2e} "
            f"accepted={r['mean_accepted_length']:.2f}"
            if "identical" in r
            else r.get("error") or r.get("skipped")
        )
        lines.append(
            f"- {r['dtype']} rows={r['row_bucket']} row_attention={r['row_attention']} {r['compressor']}: {what}"
        )
    if results["errors"]:
        lines += ["", "Errors:", *[f"- {k}: {v.splitlines()[0]}" for k, v in results["errors"].items()]]
    (args.out / "gpu_bench.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if not results["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
