"""Does a grammar make drafts easier or harder to accept? VeriCache on the three real prompts, free
and under two response formats (any JSON; a tool-call JSON schema), SnapKV at 1/8, x=16, greedy,
128 new tokens, SmolLM2; each output checked against full-KV decoding under the same grammar.
Writes benchmarks/results/constrained.{json,md}.

    .venv/bin/python benchmarks/constrained_acceptance.py
"""

from __future__ import annotations

import json
import time

from vericache_sglang.bench.common import PROMPTS, RESULTS, table
from vericache_sglang.engine.engine import Engine, compare

CALL = {
    "type": "object",
    "properties": {"tool": {"type": "string", "maxLength": 40}, "arguments": {"type": "object"}},
    "required": ["tool", "arguments"],
    "additionalProperties": False,
}
FORMATS = {
    "free": None,
    "json_object": {"type": "json_object"},
    "json_schema (tool call)": {"type": "json_schema", "json_schema": {"name": "call", "schema": CALL}},
}
COMPRESSOR, HORIZON, NEW = "snapkv:ratio=0.125", 16, 128


def main() -> None:
    engine = Engine("smollm2")
    rows = []
    for name in ("code", "prose", "tools"):
        pre = engine.prefill(engine.encode((PROMPTS / f"{name}.txt").read_text()), reuse_prefix=False)
        for label, fmt in FORMATS.items():
            cfg = engine.config(
                max_new_tokens=NEW,
                horizon=HORIZON,
                keep_logits=True,
                constraint=None if fmt is None else engine.constraint(fmt),
            )
            ref = engine.generate(pre, "full", cfg=cfg)
            t = time.monotonic()
            out = engine.generate(pre, "vericache", COMPRESSOR, cfg=cfg)
            cmp = compare(ref, out)
            rows.append(
                {
                    "prompt": name,
                    "format": label,
                    "mean_accepted_length": out.stats.mean_accepted_length,
                    "acceptance_rate": out.stats.acceptance_rate,
                    "tokens": len(out.tokens),
                    "identical": cmp["identical"],
                    "max_logit_abs_diff": cmp["max_logit_abs_diff"],
                    "seconds": round(time.monotonic() - t, 1),
                }
            )
            print(rows[-1], flush=True)
    (RESULTS / "constrained.json").write_text(json.dumps(rows, indent=2))
    (RESULTS / "constrained.md").write_text(
        f"# Acceptance under a grammar ({COMPRESSOR}, x={HORIZON}, greedy, {NEW} new tokens, SmolLM2)\n\n"
        + table(
            rows,
            [
                "prompt",
                "format",
                "mean_accepted_length",
                "acceptance_rate",
                "tokens",
                "identical",
                "max_logit_abs_diff",
                "seconds",
            ],
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
