"""Acceptance of every compressor against horizon and ratio on SmolLM2's three real prompt kinds,
the KL drift of lossy decoding against the step (the paper's Figure 4), and the adaptive horizon
against every static horizon under a declared cost model. Parameters: benchmarks/configs/
acceptance.json, fixed before measuring.

The grid comes from the teacher-forced estimator (vericache_sglang/bench/acceptance.py); the
``live_checks`` points are also run live with VeriCache and both numbers are reported. Writes
acceptance.json, acceptance.md and PNG plots to benchmarks/results/ (``--out`` elsewhere).
Run: ``python benchmarks/acceptance.py [--quick]``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vericache_sglang.bench.common import PROMPTS, RESULTS, load_config

QUANT_BITS = {"kivi": (2, 4), "kvquant": (2, 4, 8), "rotatekv": (2, 4)}


def spec_for(name: str, ratio: float, prompt_tokens: int) -> str | None:
    """The spec keeping about ``ratio`` of the full KV's bytes (None where a method has no such setting)."""
    bits = round(16 * ratio)
    if name == "streamingllm":
        return f"streamingllm:sink=4,window={max(1, round(ratio * prompt_tokens) - 4)}"
    if name in QUANT_BITS:
        return f"{name}:bits={bits}" if bits in QUANT_BITS[name] else None
    if name in ("int8", "int4"):
        return name if bits == int(name[3:]) else None
    if name == "snapkv+kivi":
        return f"snapkv:ratio={4 * ratio}+kivi:bits=4" if 4 * ratio <= 1 else None
    return f"{name}:ratio={ratio}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--config", type=Path)
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--replot", action="store_true", help="redraw the table and plots from acceptance.json in --out")
    args = p.parse_args(argv)
    if args.replot:
        out = json.loads((args.out / "acceptance.json").read_text())
        (args.out / "acceptance.md").write_text(report(out))
        plots(out, args.out)
        return 0
    cfg = load_config("acceptance", args.config, args.quick)

    import torch

    from vericache_sglang.bench.acceptance import MatchLengths, Trajectory, all_horizons, kl_curve, simulate, throughput
    from vericache_sglang.core.compress import parse_spec
    from vericache_sglang.core.horizon import AdaptiveHorizon, WindowCost
    from vericache_sglang.engine.engine import Engine

    torch.set_num_threads(cfg["threads"])
    engine = Engine(cfg["model"])
    runner = engine.runner
    rows, live, kl, adaptive = [], [], {}, []
    started = time.monotonic()
    for kind in cfg["prompts"]:
        tokens = engine.encode((PROMPTS / f"{kind}.txt").read_text())
        pre = engine.prefill(tokens, reuse_prefix=False)
        gen = engine.config(max_new_tokens=cfg["new_tokens"], keep_logits=True)
        reference = engine.generate(pre, "full", cfg=gen)
        traj = Trajectory.of(runner, pre, reference)
        n = len(reference.tokens)
        matches: dict[str, MatchLengths] = {}
        for name in cfg["compressors"]:
            for ratio in cfg["ratios"]:
                spec = spec_for(name, ratio, len(tokens))
                if spec is None:
                    continue
                t = time.monotonic()
                match = MatchLengths(runner, pre, traj, parse_spec(spec))
                per_x = all_horizons(match, n, cfg["horizons"])
                matches[spec] = match
                ckv_bytes = match.ckv.nbytes
                for x, st in per_x.items():
                    rows.append(
                        {
                            "prompt": kind,
                            "compressor": name,
                            "ratio": ratio,
                            "spec": spec,
                            "horizon": x,
                            "mean_accepted_length": st["mean_accepted_length"],
                            "acceptance_rate": st["acceptance_rate"],
                            "windows": st["windows"],
                            "compressed_over_full": ckv_bytes / pre.kv.nbytes,
                        }
                    )
                print(
                    f"{kind:6s} {spec:48s} "
                    + " ".join(f"x={x}:{st['mean_accepted_length']:.2f}" for x, st in per_x.items())
                    + f"  ({time.monotonic() - t:.0f}s)",
                    flush=True,
                )
        for name, ratio, check_kind, x in cfg["live_checks"]:
            if check_kind != kind:
                continue
            spec = spec_for(name, ratio, len(tokens))
            res = engine.generate(pre, "vericache", spec, engine.config(max_new_tokens=cfg["new_tokens"], horizon=x))
            est = simulate(matches[spec], n, x) if spec in matches else None
            live.append(
                {
                    "prompt": kind,
                    "spec": spec,
                    "horizon": x,
                    "live_mean_accepted_length": res.stats.mean_accepted_length,
                    "estimated_mean_accepted_length": est and est["mean_accepted_length"],
                    "live_identical": res.tokens == reference.tokens,
                }
            )
        if kind == cfg["kl"]["prompt"]:
            for name in cfg["compressors"]:
                spec = spec_for(name, cfg["kl"]["ratio"], len(tokens))
                if spec is not None:
                    kl[spec] = kl_curve(runner, pre, traj, parse_spec(spec))
        ad = cfg["adaptive"]
        for name in ad["compressors"]:
            spec = spec_for(name, ad["ratio"], len(tokens))
            match = matches.get(spec) or MatchLengths(runner, pre, traj, parse_spec(spec))
            for model, c in ad["cost_models"].items():
                cost = WindowCost(**c)
                policy = AdaptiveHorizon(max_horizon=ad["max_horizon"])
                entry = {"prompt": kind, "spec": spec, "cost_model": model}
                for x in cfg["horizons"]:
                    entry[f"static_{x}"] = throughput(simulate(match, n, x), cost)
                st = simulate(match, n, lambda d, a, cost=cost, policy=policy: policy.choose(d, a, cost))
                entry["adaptive"] = throughput(st, cost)
                entry["adaptive_mean_horizon"] = sum(st["horizons"]) / len(st["horizons"])
                adaptive.append(entry)
    out = {
        "config": cfg,
        "grid": rows,
        "live_checks": live,
        "kl": kl,
        "adaptive": adaptive,
        "seconds": time.monotonic() - started,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "acceptance.json").write_text(json.dumps(out, indent=1))
    (args.out / "acceptance.md").write_text(report(out))
    plots(out, args.out)
    print(report(out))
    return 0


def report(out: dict) -> str:
    cfg = out["config"]
    hs = cfg["horizons"]
    lines = [
        "# Acceptance by compressor, ratio and horizon (SmolLM2-135M-Instruct)",
        "",
        f"Teacher-forced estimate along the full-KV greedy trajectory, {cfg['new_tokens']} new tokens per prompt; "
        "mean accepted length = tokens committed per verification. Reproduce: "
        "`python benchmarks/acceptance.py`.",
        "",
        "| prompt | compressor | ratio | bytes kept | "
        + " | ".join(f"x={x}" for x in hs)
        + f" | accept rate x={hs[0]} |",
        "|" + " --- |" * (5 + len(hs)),
    ]
    cells: dict[tuple, dict] = {}
    for r in out["grid"]:
        cells.setdefault((r["prompt"], r["compressor"], r["ratio"]), {})[r["horizon"]] = r
    for (kind, name, ratio), by_x in cells.items():
        first = by_x[hs[0]]
        lines.append(
            f"| {kind} | {name} | {ratio:g} | {first['compressed_over_full']:.3f} | "
            + " | ".join(f"{by_x[x]['mean_accepted_length']:.2f}" for x in hs)
            + f" | {first['acceptance_rate']:.2f} |"
        )
    lines += [
        "",
        "## Estimator against live runs",
        "",
        "| prompt | spec | x | live | estimated | live identical |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for c in out["live_checks"]:
        lines.append(
            f"| {c['prompt']} | `{c['spec']}` | {c['horizon']} | {c['live_mean_accepted_length']:.2f} | "
            f"{c['estimated_mean_accepted_length']:.2f} | {c['live_identical']} |"
        )
    lines += [
        "",
        "## Adaptive horizon against static horizons (tokens per draft-step time, declared cost model)",
        "",
        "| cost model | prompt | spec | " + " | ".join(f"x={x}" for x in hs) + " | adaptive | mean adaptive x |",
        "|" + " --- |" * (5 + len(hs)),
    ]
    for a in out["adaptive"]:
        lines.append(
            f"| {a['cost_model']} | {a['prompt']} | `{a['spec']}` | "
            + " | ".join(f"{a[f'static_{x}']:.3f}" for x in hs)
            + f" | **{a['adaptive']:.3f}** | {a['adaptive_mean_horizon']:.1f} |"
        )
    lines += ["", "Mean over the declared mix (equal weight per prompt kind and compressor):", ""]
    for model in cfg["adaptive"]["cost_models"]:
        sel = [a for a in out["adaptive"] if a["cost_model"] == model]
        means = {k: sum(a[k] for a in sel) / len(sel) for k in [*(f"static_{x}" for x in hs), "adaptive"]}
        best = max((k for k in means if k != "adaptive"), key=means.get)
        lines.append(
            f"- {model}: "
            + ", ".join(f"{k} {v:.3f}" for k, v in means.items())
            + f"; adaptive / best static ({best}) = {means['adaptive'] / means[best]:.3f}"
        )
    if out["kl"]:
        where = f"{cfg['kl']['prompt']}, ratio {cfg['kl']['ratio']}"
        lines += [
            "",
            f"## KL of lossy decoding from full-KV decoding ({where})",
            "",
            "| spec | mean KL steps 1-16 | mean KL last 16 steps | sequence KL |",
            "| --- | --- | --- | --- |",
        ]
        for spec, curve in out["kl"].items():
            lines.append(f"| `{spec}` | {sum(curve[1:17]) / 16:.3f} | {sum(curve[-16:]) / 16:.3f} | {sum(curve):.2f} |")
    return "\n".join(lines) + "\n"


def plots(out: dict, where: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg = out["config"]
    kinds, ratios, hs = cfg["prompts"], cfg["ratios"], cfg["horizons"]
    names = list(dict.fromkeys(r["compressor"] for r in out["grid"]))
    from cycler import cycler

    # 16 compressors: 20 colours and 4 markers, so no two lines look alike
    style = cycler(color=plt.cm.tab20.colors[:16]) + cycler(marker=["o", "s", "^", "D"] * 4)
    plt.rcParams["axes.prop_cycle"] = style
    metrics = (("mean_accepted_length", "mean accepted length"), ("acceptance_rate", "acceptance rate"))
    x_mid = hs[min(1, len(hs) - 1)]
    for metric, label in metrics:
        # against the horizon at the smallest ratio, and against the ratio at the second horizon
        _grid_figure(
            plt,
            out["grid"],
            kinds,
            names,
            metric,
            label,
            "horizon",
            "ratio",
            min(ratios),
            "horizon x",
            where / f"acceptance_{metric}_vs_horizon.png",
        )
        _grid_figure(
            plt,
            out["grid"],
            kinds,
            names,
            metric,
            label,
            "ratio",
            "horizon",
            x_mid,
            "ratio (kept fraction of the full KV)",
            where / ("acceptance_vs_ratio.png" if metric == "mean_accepted_length" else "acceptance_rate_vs_ratio.png"),
        )
    if out["kl"]:
        fig, ax = plt.subplots(figsize=(7, 4))
        for spec, curve in out["kl"].items():
            total = list(itertools.accumulate(curve))
            name = "+".join(part.split(":")[0] for part in spec.split("+"))
            ax.plot(range(len(total)), total, label=name, markevery=8)
        ax.set_yscale("symlog", linthresh=1.0)
        ax.set_xlabel("decoding step")
        ax.set_ylabel("sequence-level KL(full || lossy), nats")
        ax.set_title(f"lossy decoding drifts ({cfg['kl']['prompt']}, ratio {cfg['kl']['ratio']})")
        ax.legend(fontsize=7, ncol=2)
        fig.tight_layout()
        fig.savefig(where / "acceptance_kl_vs_step.png", dpi=110)
        plt.close(fig)


def _grid_figure(
    plt,
    grid: list[dict],
    kinds: list[str],
    names: list[str],
    metric: str,
    label: str,
    axis: str,
    fixed_key: str,
    fixed: float,
    xlabel: str,
    path: Path,
) -> None:
    """One panel per prompt kind: ``metric`` of every compressor against ``axis``, ``fixed_key`` held."""
    fig, axes = plt.subplots(1, len(kinds), figsize=(5 * len(kinds), 4), squeeze=False)
    for ax, kind in zip(axes[0], kinds, strict=True):
        for name in names:
            pts = sorted(
                (r[axis], r[metric])
                for r in grid
                if r["prompt"] == kind and r["compressor"] == name and r[fixed_key] == fixed
            )
            if pts:
                ax.plot(*zip(*pts, strict=True), label=name)
        ax.set_title(f"{kind}, {'x=' if fixed_key == 'horizon' else 'ratio '}{fixed:g}")
        ax.set_xlabel(xlabel)
        ax.set_xscale("log", base=2)
        ax.set_ylabel(label)
    axes[0][-1].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
