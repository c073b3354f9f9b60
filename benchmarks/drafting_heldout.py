"""Issue #16's acceptance targets on prompts no configuration was tuned on.

The x=32 configuration (``kvzip:ratio=0.03125+refresh:ratio=0.092,span=14``) was found by a sweep
on the three benchmark prompts (``drafting_x32_check.py``), so its 20.15 there is in-sample. This
script measures it, the earlier fixed configuration, the README's recommended one and plain SnapKV
at 1/8 on three held-out prompts of the same kinds (``benchmarks/prompts/heldout/``: another
standard-library module, another section of the language reference, a tool-calling transcript of
another domain), all fixed before this run: replay at x=16 and x=32 over 256 new tokens, the
outputs' 4-gram repetition beside them, and live VeriCache for the x=32 configuration (identity
with full-KV decoding, max |dlogit|). Writes ``benchmarks/results/drafting_heldout.{json,md}``.
Run: ``python benchmarks/drafting_heldout.py`` (70 min on 2 cores with a CI run beside it).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # drafting.py's helpers

from vericache_sglang.bench.common import PROMPTS, RESULTS, table

X32 = "kvzip:ratio=0.03125+refresh:ratio=0.092,span=14"
SPECS = {
    "x=32 sweep's best": X32,
    "earlier fixed (span 16)": "kvzip:ratio=0.03125+refresh:ratio=0.09375,span=16",
    "recommended": "snapkv:ratio=0.03125+refresh:ratio=0.09375,span=16+lookup:trust=0",
    "snapkv 1/8": "snapkv:ratio=0.125",
}
KINDS = ("code", "prose", "tools")
HORIZONS = (16, 32)
NEW_TOKENS = 256


def main() -> int:
    import torch
    from drafting import geomean, live_check, repetition

    from vericache_sglang.bench.acceptance import Trajectory, replay
    from vericache_sglang.core.compress import parse_spec
    from vericache_sglang.engine.engine import Engine

    torch.set_num_threads(2)
    started = time.monotonic()
    engine = Engine("smollm2")
    out: dict = {"specs": SPECS, "new_tokens": NEW_TOKENS, "prompts": {}, "replay": [], "live": []}
    for kind in KINDS:
        tokens = engine.encode((PROMPTS / "heldout" / f"{kind}.txt").read_text())
        pre = engine.prefill(tokens, reuse_prefix=False)
        ref = engine.generate(pre, "full", cfg=engine.config(max_new_tokens=NEW_TOKENS, keep_logits=True))
        traj = Trajectory.of(engine.runner, pre, ref)
        out["prompts"][kind] = {"prompt_tokens": len(tokens), "new_tokens": len(ref.tokens),
                                "repetition_4gram": repetition(ref.tokens)}
        for label, spec in SPECS.items():
            for x in HORIZONS:
                st = replay(engine.runner, pre, traj, parse_spec(spec), x)
                out["replay"].append({"config": label, "prompt": kind, "horizon": x,
                                      "mean_accepted_length": st["mean_accepted_length"],
                                      "bytes_over_full": st["compressed_kv_bytes"] / pre.kv.nbytes})
                print(json.dumps(out["replay"][-1]), file=sys.stderr, flush=True)
        out["live"].append({"prompt": kind, **live_check(engine, pre, ref, traj, X32, 32, NEW_TOKENS)})
        print(json.dumps(out["live"][-1]), file=sys.stderr, flush=True)
    for label in SPECS:
        for x in HORIZONS:
            per = [r["mean_accepted_length"] for r in out["replay"] if r["config"] == label and r["horizon"] == x]
            out.setdefault("geomean", []).append({"config": label, "horizon": x, "geomean": geomean(per)})
    out["seconds"] = time.monotonic() - started
    (RESULTS / "drafting_heldout.json").write_text(json.dumps(out, indent=1))
    (RESULTS / "drafting_heldout.md").write_text(report(out))
    print(report(out))
    return 0


def report(out: dict) -> str:
    rows = []
    for label, spec in out["specs"].items():
        for x in HORIZONS:
            per = {r["prompt"]: r for r in out["replay"] if r["config"] == label and r["horizon"] == x}
            gm = next(g["geomean"] for g in out["geomean"] if g["config"] == label and g["horizon"] == x)
            rows.append({"configuration": label, "spec": f"`{spec}`", "x": x,
                         **{k: f"{per[k]['mean_accepted_length']:.2f}" for k in KINDS}, "geomean": f"**{gm:.2f}**",
                         "bytes / full KV": f"{max(r['bytes_over_full'] for r in per.values()):.4f}"})
    live = [{"prompt": r["prompt"], "x": r["horizon"], "live accepted": f"{r['live_mean_accepted_length']:.2f}",
             "replay": f"{r['estimated_mean_accepted_length']:.2f}", "identical": r["identical"],
             "max abs dlogit": f"{r['max_logit_diff']:.2e}"} for r in out["live"]]
    prompts = [{"prompt": k, "prompt tokens": p["prompt_tokens"], "new tokens": p["new_tokens"],
                "4-gram repetition": f"{p['repetition_4gram']:.2f}"} for k, p in out["prompts"].items()]
    return "\n\n".join([
        "# Held-out prompts: committed tokens per verification (issue #16's targets)",
        f"SmolLM2-135M-Instruct, greedy, {out['new_tokens']} new tokens, replay along the full-KV trajectory. "
        "Prompts in `benchmarks/prompts/heldout/`; no configuration was tuned on them. "
        f"Run: `python benchmarks/drafting_heldout.py` ({out['seconds'] / 60:.0f} min).",
        table(rows, ["configuration", "spec", "x", *KINDS, "geomean", "bytes / full KV"]),
        "## Prompts and the full-KV outputs' repetition (share of 4-grams seen earlier in the output)",
        table(prompts, ["prompt", "prompt tokens", "new tokens", "4-gram repetition"]),
        f"## Live VeriCache, `{X32}`, against its replay",
        table(live, ["prompt", "x", "live accepted", "replay", "identical", "max abs dlogit"]),
    ]) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
