"""The full exactness matrix (slow; run before resolving): 3 real prompts x 6 compressors (the
drafting modifiers included) x {greedy x=16, greedy x=32, sampled x=16}, 256 new tokens, every
run identical to full KV."""

import importlib.util

import pytest
from conftest import REPO

pytestmark = [pytest.mark.slow, pytest.mark.real_model]


def test_full_matrix_identical(exactness):
    spec = importlib.util.spec_from_file_location("exactness_matrix", REPO / "benchmarks" / "exactness_matrix.py")
    matrix = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(matrix)
    rows = matrix.run_matrix(256)
    for r in rows:
        exactness(
            f"matrix {r['prompt']} {r['compressor']} {r['mode']} x={r['horizon']}",
            {
                "identical": r["identical"],
                "compared_tokens": r["generated_tokens"],
                "max_logit_abs_diff": r["max_logit_abs_diff"],
            },
        )
    assert len(rows) == len(matrix.PROMPTS) * len(matrix.COMPRESSORS) * 3  # greedy x=16, x=32, sampled
    bad = [r for r in rows if not r["identical"]]
    assert not bad, bad
