"""Smoke test: benchmarks/moe.py runs end to end and ends with its JSON line."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow  # the benchmark end to end
def test_benchmark_smoke():
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "moe.py"), "--quick"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = json.loads(proc.stdout.strip().splitlines()[-1])
    assert last["bench"] == "moe"
    assert last["max_grad_rel_diff"] < 1e-5
    assert last["grad_norm_rel_diff"] < 1e-6
    assert set(last["tokens_per_s"]) == {"ep1", "ep2"}
    assert all(v > 0 for v in last["tokens_per_s"].values())
    assert last["a2a_bytes_per_step_per_rank"]["ep1"] == 0
    assert last["a2a_bytes_per_step_per_rank"]["ep2"] > 0
