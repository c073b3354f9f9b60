"""How a decode iteration's time grows with the batch on this machine (SmolLM2, full KV resident,
the 2,297-token prose prompt per request): the measurement behind the README's explanation of the
long-context results. Writes benchmarks/results/batch_scaling.md.

    python benchmarks/batch_scaling.py [--threads 2]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from vericache_sglang.engine.engine import Engine
from vericache_sglang.engine.runner import ResidentKV, Segment

HERE = Path(__file__).resolve().parent


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batches", type=int, nargs="*", default=[1, 2, 4, 8, 12])
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    engine = Engine("smollm2")
    runner = engine.runner
    pre = engine.prefill(engine.encode((HERE / "prompts" / "prose.txt").read_text()), reuse_prefix=False)
    n = len(pre.tokens)
    rows = []
    for b in args.batches:
        contexts = [ResidentKV.from_full(pre.kv, n + 8, runner.device) for _ in range(b)]
        times = []
        for i in range(6):
            t = time.perf_counter()
            runner.forward([Segment([1], [n + i], c, logits="last") for c in contexts])
            times.append(time.perf_counter() - t)
        median = sorted(times[1:])[2]
        rows.append((b, median))
        print(f"batch {b:2d}: {1e3 * median:6.1f} ms per iteration, {b / median:5.1f} tok/s", flush=True)
    lines = [f"Decode iteration time against batch size: SmolLM2-135M-Instruct float32, {args.threads} threads, "
             f"full KV of a {n}-token prompt per request, median of 5.", "",
             "| batch | ms per iteration | tokens/s |", "|---:|---:|---:|"]
    lines += [f"| {b} | {1e3 * t:.1f} | {b / t:.1f} |" for b, t in rows]
    (HERE / "results" / "batch_scaling.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
