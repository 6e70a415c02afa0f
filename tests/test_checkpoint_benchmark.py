"""Smoke tests of benchmarks/checkpoint.py: the simulation (default run) and --quick (slow)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.checkpoint import main

REPO = Path(__file__).resolve().parent.parent


def test_simulation_balances_real_model_shapes(capsys):
    result = main(["--simulate", "--sim-worlds", "128", "--sim-models", "Llama-3-8B", "--plot", ""])
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last == json.loads(json.dumps(result))
    assert last["bench"] == "checkpoint"
    assert last["sim_max_imbalance_ours"] <= 1.05
    llama = last["sim"]["Llama-3-8B replicated"]
    assert llama["dcp_default"]["128"] > 4 * llama["ours"]["128"]  # two 1 GB matrices unsplit
    assert last["sim_max_over_bound_ours"] <= 1.05
    assert llama["ours"]["128"] <= 1.05 and llama["bound"]["128"] == 1.0


@pytest.mark.slow
def test_quick_benchmark_runs(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "checkpoint.py"), "--quick", "--plot", ""],
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = json.loads(proc.stdout.strip().splitlines()[-1])
    for key in (
        "layouts",
        "imbalance_ours",
        "imbalance_dcp_default",
        "sim_max_imbalance_ours",
        "raw_write_speedup_4_vs_1",
        "linked",
    ):
        assert key in last
    assert set(last["linked"]["save_s"]) == {"lowest_rank", "dcp_default", "ours", "ours_nocrc"}
    assert last["imbalance_ours"] <= 1.05
    assert all(v["loads_equal"] for layout in last["layouts"].values() for v in layout.values())


@pytest.mark.slow
def test_link_sweep_runs(capsys):
    result = main(["--quick", "--link-sweep", "400,0", "--plot", ""])
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last == json.loads(json.dumps(result))
    assert last["bench"] == "checkpoint_link_sweep"
    assert set(last["save_s"]) == {"400", "0"}
    for row in last["save_s"].values():
        assert set(row) == {"lowest_rank", "dcp_default", "ours", "ours_nocrc"}
        assert all(seconds > 0 for seconds in row.values())


@pytest.mark.slow
def test_lab_benchmark_runs(capsys):
    """--lab in a real lab (root, namespaces, sshfs): one round, the replicated layout."""
    from fsdp_ext.lab import unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    result = main(["--lab", "--lab-reps", "1", "--lab-layouts", "replicated"])
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last == json.loads(json.dumps(result)) and last["bench"] == "checkpoint_lab"
    for key in (
        "lab_save_speedup_vs_lowest_rank",
        "lab_save_ratio_vs_dcp_default",
        "lab_load_ratio_vs_dcp_default",
    ):
        assert last[key] > 0
    row = last["per_rate"]["200"]["replicated"]
    assert all(v["loads_equal"] for v in row.values())
    # bytes each node sent to the storage, from its interface counters: the lowest-rank
    # writer's node sends everything, ours spreads it (the embedding is split)
    sent = {v: row[v]["storage_sent_mb_per_rank"] for v in row}
    assert max(sent["lowest_rank"]) > 3 * max(sent["ours"])
    assert max(sent["ours"]) / (sum(sent["ours"]) / 4) < 1.15
