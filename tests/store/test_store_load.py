"""A bounded load from several processes on loopback: no lost or mixed-up records."""

import json
import subprocess
import sys

import pytest
from conftest import REPO

pytestmark = pytest.mark.service


@pytest.mark.parametrize("which", ["redis_url", "store_url"])
def test_multiprocess_load_loses_and_mixes_nothing(request, which):
    url = request.getfixturevalue(which)
    done = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "store_load.py"),
            "--url",
            url,
            "--procs",
            "4",
            "--ops",
            "60",
            "--seconds",
            "8",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    result = json.loads(done.stdout)
    assert done.returncode == 0 and result["errors"] == 0, result["examples"]
    assert result["exit_codes"] == [0, 0, 0, 0]
    assert result["ops"] >= 4 * 10
