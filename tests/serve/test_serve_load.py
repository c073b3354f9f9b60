"""8 concurrent streams for 60 s against the two-server cluster, the store killed and restarted
under them (benchmarks/serve_load.py): no request emits a token that is not full-KV decoding's, the
ones the outage touches fall back (or fail cleanly), and the servers recover. Slow: run before
resolving; its last results are in benchmarks/results/serve_load.*."""

import json
import subprocess
import sys

import pytest
from conftest import REPO

pytestmark = [pytest.mark.slow, pytest.mark.real_model]


def test_load_with_the_store_killed(tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "serve_load.py"),
            "--streams",
            "8",
            "--seconds",
            "60",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    summary = json.loads((tmp_path / "serve_load.json").read_text())["summary"]
    assert done.returncode == 0, (summary, done.stderr[-3000:])
    assert summary["unverified_or_wrong_tokens"] == 0 and summary["requests"] >= 16
    assert summary["requests_touching_outage"] > 0
    assert summary["outage_fallbacks"] + summary["outage_failed"] > 0  # the outage was felt, and handled
    assert summary["after_recovery"] > 0
    assert summary["after_recovery_ok_without_fallback"] == summary["after_recovery"]
    assert summary["servers_healthy_after"] and summary["clean_shutdown"]
