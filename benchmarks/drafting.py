"""Drafting beyond a compressor (issue #16): verification-guided refresh on and off for every
dropper, prompt-lookup composition (share of drafts per source), the peers' drafting side by side
under one cost model, and acceptance along a long generation. Parameters:
benchmarks/configs/drafting.json, fixed before measuring.

Every number comes from the engine's window-by-window replay along the full-KV greedy trajectory
(``replay`` in vericache_sglang/bench/acceptance.py: the compressed KV folded and refreshed window
by window as the engine does); ``live_checks`` run VeriCache itself and report both, with the
output's identity. Writes drafting.{json,md,png} to benchmarks/results/ (``--out`` elsewhere).
Run: ``python benchmarks/drafting.py [--quick]``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vericache_sglang.bench.common import PROMPTS, RESULTS, load_config, table
from vericache_sglang.core.horizon import WindowCost


def geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values and min(values) > 0 else 0.0


def repetition(tokens: list[int], n: int = 4) -> float:
    """Share of the output's n-grams that occurred earlier in it (0: none repeats)."""
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    return 1.0 - len(set(grams)) / len(grams) if grams else 0.0


def dropper_spec(name: str, ratio: float, prompt_tokens: int, refresh: dict | None) -> str:
    """``name`` at ``ratio`` of the bytes; with ``refresh``, ``base_share`` of it for the dropper and
    the rest in refreshed rows."""
    base = ratio if refresh is None else ratio * refresh["base_share"]
    spec = (
        f"streamingllm:sink=4,window={max(1, round(base * prompt_tokens) - 4)}"
        if name == "streamingllm"
        else f"{name}:ratio={base:g}"
    )
    if refresh is not None:
        spec += f"+refresh:ratio={ratio - base:g},span={refresh['span']}"
    return spec


def peer_spec(spec: str, ratio: float, prompt_tokens: int) -> str:
    """A peer's spec; ``streamingllm`` (MagicDec) is sized to ``ratio`` of the prompt like the droppers."""
    return dropper_spec("streamingllm", ratio, prompt_tokens, None) if spec == "streamingllm" else spec


def reads_compressed_kv(compressor) -> bool:
    """False for prompt lookup alone, whose drafts read no compressed KV (its bytes count 0)."""
    return compressor.lookup is None or compressor.lookup.model


def window_cost(stats: dict, cost: dict) -> float:
    """Committed tokens per unit time: each window costs ``WindowCost.window_s`` of its draft
    forwards (drafting overlaps the full KV's reload)."""
    time_units = sum(WindowCost(**cost).window_s(f) for f in stats["forwards"])
    return sum(stats["committed"]) / time_units if time_units else 0.0


def live_check(engine, pre, reference, traj, spec: str, x: int, new_tokens: int) -> dict:
    """Live VeriCache against the replay estimate, on the prefill ``pre`` whose full-KV decoding of
    ``new_tokens`` is ``reference`` (trajectory ``traj``): accepted lengths, forwards, lookup
    drafts, and the output's identity with full-KV decoding."""
    from vericache_sglang.bench.acceptance import replay
    from vericache_sglang.core.compress import parse_spec
    from vericache_sglang.engine.engine import compare

    est = replay(engine.runner, pre, traj, parse_spec(spec), x)
    res = engine.generate(pre, "vericache", spec, engine.config(max_new_tokens=new_tokens, horizon=x, keep_logits=True))
    cmp = compare(reference, res)
    return {
        "spec": spec,
        "horizon": x,
        "live_mean_accepted_length": res.stats.mean_accepted_length,
        "estimated_mean_accepted_length": est["mean_accepted_length"],
        "live_forwards": res.stats.decode_steps,
        "estimated_forwards": sum(est["forwards"]),
        "live_lookup_drafted": res.stats.lookup_drafted,
        "compressed_kv_bytes": est["compressed_kv_bytes"],
        "identical": cmp["identical"],
        "max_logit_diff": cmp["max_logit_abs_diff"],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--config", type=Path)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    cfg = load_config("drafting", args.config, args.quick)

    import torch

    from vericache_sglang.bench.acceptance import Trajectory, replay
    from vericache_sglang.core.compress import parse_spec
    from vericache_sglang.engine.engine import Engine

    torch.set_num_threads(cfg["threads"])
    engine = Engine(cfg["model"])
    runner = engine.runner
    started = time.monotonic()
    log = lambda s: print(s, file=sys.stderr, flush=True)
    out = {"config": cfg, "grid": [], "peers": [], "rag": [], "long": [], "live_checks": [], "outputs": {}}
    prepared = {}
    for kind in sorted(set(cfg["prompts"]) | {cfg["long"]["prompt"]}):
        tokens = engine.encode((PROMPTS / f"{kind}.txt").read_text())
        prepared[kind] = (tokens, engine.prefill(tokens, reuse_prefix=False))

    def trajectory(kind: str, n: int) -> tuple:
        pre = prepared[kind][1]
        reference = engine.generate(pre, "full", cfg=engine.config(max_new_tokens=n, keep_logits=True))
        return pre, reference, Trajectory.of(runner, pre, reference)

    trajs = {}
    for kind in cfg["prompts"]:
        pre, reference, traj = trajs[kind] = trajectory(kind, cfg["new_tokens"])
        out["outputs"][kind] = {"tokens": len(reference.tokens), "repetition_4gram": repetition(reference.tokens)}
        log(
            f"{kind}: {len(prepared[kind][0])} prompt tokens, reference of {len(reference.tokens)} "
            f"(4-gram repetition {repetition(reference.tokens):.2f})"
        )

    def measure(kind: str, spec: str, x: int) -> dict:
        pre, _, traj = trajs[kind]
        compressor = parse_spec(spec)
        st = replay(runner, pre, traj, compressor, x)
        st["bytes_over_full"] = st["compressed_kv_bytes"] / pre.kv.nbytes if reads_compressed_kv(compressor) else 0.0
        return st

    for name in cfg["droppers"]:
        for refresh in (None, cfg["refresh"]):
            for kind in cfg["prompts"]:
                spec = dropper_spec(name, cfg["ratio"], len(prepared[kind][0]), refresh)
                for x in cfg["horizons"]:
                    st = measure(kind, spec, x)
                    out["grid"].append(
                        {
                            "dropper": name,
                            "refresh": refresh is not None,
                            "prompt": kind,
                            "horizon": x,
                            "spec": spec,
                            "mean_accepted_length": st["mean_accepted_length"],
                            "bytes_over_full": st["bytes_over_full"],
                        }
                    )
            log(
                f"{name} refresh={'on' if refresh else 'off'}: "
                + " ".join(
                    f"{r['prompt']}/x={r['horizon']}:{r['mean_accepted_length']:.2f}"
                    for r in out["grid"][-len(cfg["prompts"]) * len(cfg["horizons"]) :]
                )
            )
    for label, spec in cfg["peers"].items():
        for kind in cfg["prompts"]:
            spec_k = peer_spec(spec, cfg["ratio"], len(prepared[kind][0]))
            for x in cfg["horizons"]:
                st = measure(kind, spec_k, x)
                row = {
                    "method": label,
                    "spec": spec_k,
                    "prompt": kind,
                    "horizon": x,
                    "mean_accepted_length": st["mean_accepted_length"],
                    "bytes_over_full": st["bytes_over_full"],
                    "forwards_per_window": sum(st["forwards"]) / len(st["forwards"]),
                    "lookup_share": st["lookup_drafted"] / st["drafted"] if st["drafted"] else 0.0,
                    "lookup_accepted": st["lookup_accepted"],
                    "accepted": st["accepted"],
                }
                for model, cost in cfg["cost_models"].items():
                    row[f"per_cost_{model}"] = window_cost(st, cost)
                out["peers"].append(row)
        log(
            f"peer {label}: "
            + " ".join(
                f"{r['prompt']}/x={r['horizon']}:{r['mean_accepted_length']:.2f}"
                for r in out["peers"]
                if r["method"] == label
            )
        )
    if cfg.get("rag"):
        out["rag"] = rag_peers(engine, cfg, log)
    long = cfg["long"]
    pre, reference, traj = trajectory(long["prompt"], long["new_tokens"])
    for spec in long["specs"]:
        st = replay(runner, pre, traj, parse_spec(spec), long["horizon"])
        buckets: dict[int, list[int]] = {}
        done = 1
        for c in st["committed"]:
            buckets.setdefault(done // long["bucket"], []).append(c)
            done += c
        out["long"].append(
            {
                "spec": spec,
                "per_window": {str(b * long["bucket"]): sum(v) / len(v) for b, v in sorted(buckets.items())},
                "mean_accepted_length": st["mean_accepted_length"],
            }
        )
        log(f"long {spec}: " + " ".join(f"{k}:{v:.1f}" for k, v in out["long"][-1]["per_window"].items()))
    for kind, spec, x in cfg["live_checks"]:
        pre, reference, traj = trajs[kind]
        out["live_checks"].append(
            {"prompt": kind, **live_check(engine, pre, reference, traj, spec, x, cfg["new_tokens"])}
        )
        row = out["live_checks"][-1]
        log(
            f"live {kind} {spec} x={x}: live {row['live_mean_accepted_length']:.2f} est "
            f"{row['estimated_mean_accepted_length']:.2f} identical={row['identical']}"
        )
    out["seconds"] = time.monotonic() - started
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "drafting.json").write_text(json.dumps(out, indent=1))
    (args.out / "drafting.md").write_text(report(out))
    plot(out, args.out / "drafting.png")
    print(report(out))
    return 0


def rag_peers(engine, cfg: dict, log) -> list[dict]:
    """The peers on the RAG setting of ``vericache bench prefix``: a shared document registered
    once per method (its compressed KV drafts at once), requests that add their own question.
    Live VeriCache runs (the request's own tokens are drafted over the compressed document, so the
    window-by-window replay does not apply), each output compared with full-KV decoding."""
    from remote_store.backends.memory import MemoryStore
    from vericache_sglang.bench.prefix import common_prefix, document_text
    from vericache_sglang.core.compress import parse_spec
    from vericache_sglang.engine.decode import generate_full, generate_vericache_from_prefix
    from vericache_sglang.engine.engine import compare
    from vericache_sglang.engine.prefill import prefill
    from vericache_sglang.engine.prefix import PrefixRegistry
    from vericache_sglang.full_kv.store import FullKVStore

    rag, runner = cfg["rag"], engine.runner
    doc = document_text(rag["document"])
    prompts = [engine.encode(f"{doc}\n\nQuestion: {q}") for q in rag["questions"]]
    shared = common_prefix(prompts)
    store = FullKVStore(MemoryStore(), runner.layout, chunk_tokens=rag["chunk_tokens"])
    rows = []
    refs = {}
    for label, spec in cfg["peers"].items():
        spec = peer_spec(spec, cfg["ratio"], len(shared))
        registry = PrefixRegistry(runner, store, parse_spec(spec))
        prefix = registry.register(shared)
        kept = prefix.compressed_kv_bytes / prefix.full_kv_bytes if reads_compressed_kv(registry.compressor) else 0.0
        for x in cfg["horizons"]:
            gen = engine.config(max_new_tokens=rag["new_tokens"], horizon=x, keep_logits=True)
            stats = {"committed": [], "forwards": [], "drafted": 0, "lookup_drafted": 0}
            identical, max_diff = True, 0.0
            for i, prompt in enumerate(prompts):
                if i not in refs:
                    full = store.load_prefix(prompt, len(prefix.tokens))
                    refs[i] = generate_full(runner, prefill(runner, prompt, prefix=full), gen, engine.tokenizer)
                res, _ = generate_vericache_from_prefix(
                    runner, prefix, prompt, registry.compressor, store, gen, engine.tokenizer
                )
                cmp = compare(refs[i], res)
                identical &= cmp["identical"]
                max_diff = max(max_diff, cmp["max_logit_abs_diff"])
                stats["committed"] += res.stats.committed
                stats["forwards"] += res.stats.draft_forwards
                stats["drafted"] += sum(res.stats.drafted)
                stats["lookup_drafted"] += res.stats.lookup_drafted
            row = {
                "method": label,
                "spec": spec,
                "horizon": x,
                "prefix_tokens": len(prefix.tokens),
                "requests": len(prompts),
                "bytes_over_full": kept,
                "mean_accepted_length": sum(stats["committed"]) / len(stats["committed"]),
                "lookup_share": stats["lookup_drafted"] / stats["drafted"] if stats["drafted"] else 0.0,
                "identical": identical,
                "max_logit_diff": max_diff,
            }
            for model, cost in cfg["cost_models"].items():
                row[f"per_cost_{model}"] = window_cost(stats, cost)
            rows.append(row)
        log(
            f"rag {label}: "
            + " ".join(
                f"x={r['horizon']}:{r['mean_accepted_length']:.2f}{'' if r['identical'] else ' NOT IDENTICAL'}"
                for r in rows
                if r["method"] == label
            )
        )
    return rows


def report(out: dict) -> str:
    cfg = out["config"]
    hs, kinds = cfg["horizons"], cfg["prompts"]
    lines = [
        "# Drafting beyond a compressor: refresh, prompt lookup, peers (SmolLM2-135M-Instruct)",
        "",
        f"{cfg['new_tokens']} new tokens per prompt, greedy; committed tokens per verification by the engine's "
        "window-by-window replay along the full-KV trajectory (checked live below). Reproduce: "
        "`python benchmarks/drafting.py`.",
        "",
        "Outputs' 4-gram repetition (share of 4-grams seen earlier in the output): "
        + ", ".join(f"{k} {v['repetition_4gram']:.2f}" for k, v in out["outputs"].items()),
        "",
        "## Refresh on and off for every dropper (1/8 of the full KV's bytes)",
        "",
    ]
    head = (
        ["dropper", "refresh", "bytes kept"]
        + [f"{k} x={x}" for x in hs for k in kinds]
        + [f"geomean x={x}" for x in hs]
    )
    rows = []
    for name in cfg["droppers"]:
        for on in (False, True):
            cells = [r for r in out["grid"] if r["dropper"] == name and r["refresh"] == on]
            row = {
                "dropper": name,
                "refresh": "on" if on else "off",
                "bytes kept": sum(r["bytes_over_full"] for r in cells) / len(cells),
            }
            for x in hs:
                vals = []
                for k in kinds:
                    v = next(r["mean_accepted_length"] for r in cells if r["prompt"] == k and r["horizon"] == x)
                    row[f"{k} x={x}"] = v
                    vals.append(v)
                row[f"geomean x={x}"] = geomean(vals)
            rows.append(row)
    lines += [
        table(rows, head),
        "",
        "## Peers side by side (same engine, prompts, cost model)",
        "",
        "Committed tokens per verification (accepted length), and committed tokens per unit cost: a window "
        "costs max(draft forwards, transfer) + verify (draft forward = 1, verify = 1.25; transfer 2.5 on a "
        "GH200-like link, 15 on PCIe 5 at 32k context); prompt lookup's drafts cost 0. `lookup share`: drafts "
        "from prompt lookup.",
        "",
    ]
    head = (
        ["method", "bytes kept"]
        + [f"accepted x={x}" for x in hs]
        + [f"{m} x={x}" for m in cfg["cost_models"] for x in hs]
        + [f"fwd/window x={hs[0]}", "lookup share"]
    )
    rows = []
    for label in cfg["peers"]:
        cells = [r for r in out["peers"] if r["method"] == label]
        row = {"method": label, "bytes kept": sum(r["bytes_over_full"] for r in cells) / len(cells)}
        for x in hs:
            at = [r for r in cells if r["horizon"] == x]
            row[f"accepted x={x}"] = geomean([r["mean_accepted_length"] for r in at])
            for m in cfg["cost_models"]:
                row[f"{m} x={x}"] = geomean([r[f"per_cost_{m}"] for r in at])
        first = [r for r in cells if r["horizon"] == hs[0]]
        row[f"fwd/window x={hs[0]}"] = sum(r["forwards_per_window"] for r in first) / len(first)
        row["lookup share"] = sum(r["lookup_share"] for r in cells) / len(cells)
        rows.append(row)
    lines += [table(rows, head), "", "(geometric means over " + ", ".join(kinds) + ")", ""]
    if out.get("rag"):
        rag = cfg["rag"]
        first = out["rag"][0]
        lines += [
            f"### On the RAG setting of `vericache bench prefix` ({first['prefix_tokens']}-token "
            f"{rag['document']} document registered once per method, {first['requests']} questions x "
            f"{rag['new_tokens']} new tokens, live runs, every output compared with full-KV decoding)",
            "",
        ]
        head = (
            ["method", "bytes kept"]
            + [f"accepted x={x}" for x in hs]
            + [f"{m} x={x}" for m in cfg["cost_models"] for x in hs]
            + ["lookup share", "identical"]
        )
        rows = []
        for label in cfg["peers"]:
            cells = [r for r in out["rag"] if r["method"] == label]
            row = {
                "method": label,
                "bytes kept": cells[0]["bytes_over_full"],
                "lookup share": sum(r["lookup_share"] for r in cells) / len(cells),
                "identical": all(r["identical"] for r in cells),
            }
            for r in cells:
                row[f"accepted x={r['horizon']}"] = r["mean_accepted_length"]
                for m in cfg["cost_models"]:
                    row[f"{m} x={r['horizon']}"] = r[f"per_cost_{m}"]
            rows.append(row)
        lines += [table(rows, head), ""]
    lines += [
        f"## Along a long generation ({cfg['long']['prompt']}, {cfg['long']['new_tokens']} tokens, "
        f"x={cfg['long']['horizon']}): accepted length per {cfg['long']['bucket']}-token window",
        "",
    ]
    for entry in out["long"]:
        lines.append(
            f"- `{entry['spec']}` (mean {entry['mean_accepted_length']:.2f}): "
            + ", ".join(f"{k}+: {v:.1f}" for k, v in entry["per_window"].items())
        )
    lines += [
        "",
        "## Replay against live VeriCache",
        "",
        table(
            out["live_checks"],
            [
                "prompt",
                "spec",
                "horizon",
                "live_mean_accepted_length",
                "estimated_mean_accepted_length",
                "live_forwards",
                "estimated_forwards",
                "live_lookup_drafted",
                "identical",
                "max_logit_diff",
            ],
        ),
        "",
        "Forwards past a window's first rejected draft are replayed as if the drafts had matched "
        "(the estimate of draft cost; accepted lengths are exact).",
        "",
    ]
    return "\n".join(lines)


def plot(out: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg = out["config"]
    x = cfg["horizons"][0]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    names = cfg["droppers"]
    for offset, on in ((-0.2, False), (0.2, True)):
        vals = [
            geomean(
                [
                    r["mean_accepted_length"]
                    for r in out["grid"]
                    if r["dropper"] == n and r["refresh"] == on and r["horizon"] == x
                ]
            )
            for n in names
        ]
        axes[0].bar([i + offset for i in range(len(names))], vals, width=0.4, label=f"refresh {'on' if on else 'off'}")
    axes[0].set_xticks(range(len(names)), names, rotation=40, ha="right", fontsize=8)
    axes[0].set_ylabel(f"accepted length, x={x} (geomean)")
    axes[0].set_title("refresh on/off, 1/8 of the full KV's bytes")
    axes[0].legend()
    for entry in out["long"]:
        pts = sorted((int(k), v) for k, v in entry["per_window"].items())
        axes[1].plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=entry["spec"][:48])
    axes[1].set_xlabel("output token")
    axes[1].set_ylabel("accepted length")
    axes[1].set_title(f"along a long generation ({cfg['long']['prompt']})")
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
