"""Where drafting misses, and whether compression can be blamed: each window's first wrong draft
at one horizon, with full-KV decoding's top-1 minus top-2 logit there (issue #33: the x=32 target).

A miss where full-KV decoding itself nearly tied (a small ``full margin``) is lost to any
perturbation of the KV, however small; a miss where full-KV decoding was sure (a large margin)
means the compressed KV lacks what the token is read from (a dropped row being copied). The
replay is ``drafting_deploy.py``'s (the engine's window-by-window replay along the full-KV greedy
trajectory of 256 tokens, SmolLM2-135M-Instruct), so the windows are the deployment measure's.

Run: ``OMP_NUM_THREADS=1 python benchmarks/drafting_misses.py --prompts tuning --horizon 32 SPEC ...``;
writes ``benchmarks/results/drafting_misses.md`` (every miss, with the text before it).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from drafting_deploy import PROMPT_SETS, prepare

from vericache_sglang.bench.common import RESULTS, table

NEAR_TIE = 0.5  # a full-KV margin below this, in logits, counts as a near tie
OUT = RESULTS / "drafting_misses.md"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("specs", nargs="+", help="compressor specs (see `vericache compressors`)")
    p.add_argument("--prompts", choices=list(PROMPT_SETS), default="tuning")
    p.add_argument("--horizon", type=int, default=32)
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)

    import torch

    from vericache_sglang.bench.acceptance import Miss, replay
    from vericache_sglang.core.compress import parse_spec
    from vericache_sglang.engine.engine import Engine

    torch.set_num_threads(args.threads)
    started = time.monotonic()
    engine = Engine("smollm2")
    prepared = prepare(engine, PROMPT_SETS[args.prompts])
    summary, detail = [], []
    for spec in args.specs:
        for kind, prep in prepared.items():
            misses: list[Miss] = []
            stats = replay(engine.runner, prep.pre, prep.traj, parse_spec(spec), args.horizon, misses=misses)
            margins = [m.full_margin for m in misses]
            summary.append(
                {
                    "spec": f"`{spec}`",
                    "prompt": kind,
                    "windows": stats["windows"],
                    "tokens per verification": f"{stats['mean_accepted_length']:.2f}",
                    "misses": len(misses),
                    f"near ties (< {NEAR_TIE})": sum(m < NEAR_TIE for m in margins),
                    "median full margin": f"{statistics.median(margins):.2f}" if margins else "-",
                }
            )
            g = prep.traj.tokens
            for m in misses:
                before = engine.tokenizer.decode(g[max(0, m.step - 10) : m.step])
                before = before.replace("\n", "\\n").replace("`", "'").replace("|", "/")
                detail.append(
                    {
                        "spec": f"`{spec}`",
                        "prompt": kind,
                        "step": m.step,
                        "text before": f"`{before}`",
                        "full KV": f"`{engine.tokenizer.decode([m.truth])!r}`",
                        "drafted": f"`{engine.tokenizer.decode([m.drafted])!r}`",
                        "full margin": f"{m.full_margin:.2f}",
                        "draft margin": f"{m.draft_margin:.2f}",
                    }
                )
            print(f"{spec} {kind}: {summary[-1]}", file=sys.stderr, flush=True)
    text = [
        "# Where drafting misses (issue #33)",
        f"SmolLM2-135M-Instruct, {args.prompts} prompts, 256 greedy tokens, horizon {args.horizon}: each "
        "window's first wrong draft along the full-KV trajectory (the deployment measure's replay). "
        "`full margin`: full-KV decoding's top-1 minus top-2 logit at that token; `draft margin`: the "
        "drafted token's logit minus the full-KV token's, in the draft pass. Reproduce: "
        f"`OMP_NUM_THREADS=1 python benchmarks/drafting_misses.py --prompts {args.prompts} "
        f"--horizon {args.horizon} SPEC ...` ({time.monotonic() - started:.0f} s).",
        table(summary, list(summary[0])),
        "## Every miss",
        table(detail, list(detail[0])) if detail else "none",
    ]
    args.out.write_text("\n\n".join(text) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
