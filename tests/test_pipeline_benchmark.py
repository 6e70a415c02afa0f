"""Smoke test: benchmarks/pipeline.py runs end to end and ends with its JSON line."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_benchmark_smoke():
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "pipeline.py"),
            "--quick",
            "--microbatches",
            "4",
        ],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = json.loads(proc.stdout.strip().splitlines()[-1])
    assert last["bench"] == "pipeline"
    rows = last["configs"]
    units = rows["deferred_fp32@M4"]["units_per_rank"]
    assert last["reduce_scatters_per_step_deferred"] == units
    assert rows["naive_fp32@M4"]["reduce_scatters_per_step"] == 4 * units
    assert rows["per_microbatch_loco@M4"]["reduce_scatters_per_step"] == 4 * units
    assert last["losses_identical"] is True
    # 4-bit per microbatch: fewer bytes than one fp32 reduction at M=4; sharded gradients
    assert 0 < last["bytes_ratio_per_microbatch_loco_vs_deferred_fp32"] < 1
    assert 0 < last["grad_bytes_ratio_per_microbatch_vs_deferred"] < 0.5
    for key in ("speedup_deferred_vs_naive", "configs"):
        assert key in last
