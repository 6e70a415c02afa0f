"""Smoke test of benchmarks/cluster.py (slow: two lab jobs of the main job, ~2-4 minutes)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.lab_helpers import require_lab

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_cluster_benchmark_runs(tmp_path):
    require_lab(storage=False)
    plot = tmp_path / "cluster.png"
    args = ["--plan", "2x2:200", "--configs", "stock_fp32,q4,loco_flat,loco_hier,auto"]
    args += ["--steps", "4", "--warmup", "1", "--val-batches", "1", "--plot", str(plot)]
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "cluster.py"), *args],
        capture_output=True,
        text=True,
        timeout=1500,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = json.loads(proc.stdout.strip().splitlines()[-1])
    for key in (
        "speedup_loco_vs_stock_fp32_at_slowest",
        "loco_step_overhead_vs_q4_max",
        "link_bytes_vs_commstats_max_rel_err",
        "rates_mbit",
        "step_ms",
        "calibration",
    ):
        assert key in last, key
    assert last["rates_mbit"] == [200]
    assert set(last["step_ms"]) == {"stock_fp32", "q4", "loco_flat", "loco_hier", "auto"}
    # --comm auto beside the fixed configurations: its ratio to the best, and its choice
    assert last["auto_over_best_2x2_200"] > 0 and last["rotate"] is True
    assert last["auto_choice_2x2_200"].startswith("weights=")
    assert last["best_fixed_2x2_200"] in {"stock_fp32", "q4", "loco_flat", "loco_hier"}
    assert set(last["load_per_job"]) == {"2x2_200"}
    # the counters: 4-bit gradients take the reduce-scatter's bytes off the link
    link = last["link_mb_per_step"]
    assert link["loco_hier"] < link["loco_flat"] <= link["q4"] * 1.01 < link["stock_fp32"]
    assert link["auto"] < link["stock_fp32"]  # 200 Mbit/s: auto compresses something
    assert last["link_bytes_vs_commstats_max_rel_err"] < 0.05
    assert last["link_bytes_vs_model_max_rel_err"] < 0.05
    assert plot.stat().st_size > 0
