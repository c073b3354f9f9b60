"""The x=32 sweep's best configuration (issue #16), checked: live VeriCache against the replay on
the three prompts at x=16 and x=32 (256 new tokens, identity with full-KV decoding), and the
winning span against the fixed configuration's over 512 new tokens at x=32 (replay).

The sweep itself (in-sample: spans and splits of KVzip + refresh, tried on these same prompts) is
``benchmarks/results/drafting_x32_sweep.jsonl``, one row per configuration and horizon. Writes
``benchmarks/results/drafting_x32_sweep_check.json``. Run: ``python benchmarks/drafting_x32_check.py``
(~10 min alone on 2 cores).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # drafting.py's live check

from vericache_sglang.bench.common import PROMPTS, RESULTS

SWEPT = "kvzip:ratio=0.03125+refresh:ratio=0.092,span=14"
FIXED = "kvzip:ratio=0.03125+refresh:ratio=0.09375,span=16"


def main() -> int:
    import torch
    from drafting import live_check

    from vericache_sglang.bench.acceptance import Trajectory, replay
    from vericache_sglang.core.compress import parse_spec
    from vericache_sglang.engine.engine import Engine

    torch.set_num_threads(2)
    engine = Engine("smollm2")
    rows = []
    for kind in ("code", "prose", "tools"):
        pre = engine.prefill(engine.encode((PROMPTS / f"{kind}.txt").read_text()), reuse_prefix=False)
        for n in (256, 512):
            ref = engine.generate(pre, "full", cfg=engine.config(max_new_tokens=n, keep_logits=True))
            traj = Trajectory.of(engine.runner, pre, ref)
            if n == 256:
                for x in (16, 32):
                    rows.append({"prompt": kind, "n": n, **live_check(engine, pre, ref, traj, SWEPT, x, n)})
                    print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
            else:
                for spec in (SWEPT, FIXED):
                    rows.append(
                        {
                            "prompt": kind,
                            "n": n,
                            "spec": spec,
                            "horizon": 32,
                            "estimated_mean_accepted_length": replay(engine.runner, pre, traj, parse_spec(spec), 32)[
                                "mean_accepted_length"
                            ],
                        }
                    )
                    print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    (RESULTS / "drafting_x32_sweep_check.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
