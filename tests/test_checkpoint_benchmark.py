"""Smoke tests of benchmarks/checkpoint.py: the simulation (default run) and --quick (slow);
the lab's S3 comparison: its arguments and last line without a lab (default run), in a real
lab (slow)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.checkpoint import S3_VARIANTS, S3FS_ENV, check_s3fs, main, s3_summary

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
    # --plot '': a one-round plot must not replace docs/checkpoint_lab.png
    result = main(["--lab", "--lab-reps", "1", "--lab-layouts", "replicated", "--plot", ""])
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


# -- --lab --storage s3: ours against stock FsspecWriter/FsspecReader on s3fs ---------------


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--storage", "s3"], "--storage s3: only with --lab"),
        (["--lab", "--storage", "nfs"], "argument --storage: invalid choice: 'nfs' (choose from"),
    ],
)
def test_s3_arguments_are_one_line_errors(argv, match, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert match in capsys.readouterr().err.strip().splitlines()[-1]


def test_a_missing_s3fs_is_one_line_naming_the_fix(tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        check_s3fs(str(tmp_path / "no-such-dir"))
    message = str(exit_info.value)
    assert "\n" not in message
    assert "needs s3fs, which does not import from" in message and "No module named" in message
    assert "pip install --target" in message and f"--s3fs-path DIR or set {S3FS_ENV}=DIR" in message


def test_the_s3_summary_has_the_ratios_and_the_storage_bytes():
    """The last line's keys from a made-up worker result: no lab needed."""

    def row(save, load, sent):
        return {
            "save_s": save,
            "load_s": load,
            "storage_sent_mb_per_rank": sent,
            "storage_received_mb_per_rank": [63.5] * 4,
            "loads_equal": True,
        }

    measured = {
        "model_mb": 63.5,
        "versions": {"s3fs": "2026.9.0"},
        "replicated": {
            "fsspec": row(2.0, 3.0, [24.0, 9.3, 9.3, 20.6]),
            "ours": row(1.5, 2.7, [16.0, 15.9, 15.8, 16.1]),
        },
    }

    class Args:
        lab_reps = 3

    result = json.loads(
        json.dumps(s3_summary(Args, 4, [200], ("replicated",), {"200": measured}, None))
    )
    assert result["s3_save_ratio_vs_fsspec"] == 0.75
    assert result["s3_load_ratio_vs_fsspec"] == 0.9
    assert result["storage_link_mb"]["fsspec"]["save_sent_max_rank"] == 24.0
    assert result["storage_link_mb"]["ours"]["load_received_total"] == 254.0
    assert result["targets"] == {"s3_save_ratio_vs_fsspec": 0.8, "s3_load_ratio_vs_fsspec": 1.0}
    assert result["loads_equal"] and set(S3_VARIANTS) == {"fsspec", "ours"}


@pytest.mark.slow
def test_lab_s3_benchmark_quick_runs(capsys):
    """--lab --storage s3 --quick in a real lab: SeaweedFS on the storage node, ours against
    stock FsspecWriter/FsspecReader on s3fs, one round (needs s3fs in $FSDP_EXT_S3FS_PATH)."""
    from fsdp_ext.lab import unavailable_reason

    reason = unavailable_reason(storage="s3")
    if reason is not None:
        pytest.skip(reason)
    if not os.environ.get(S3FS_ENV):
        pytest.skip(f"set {S3FS_ENV} to a directory holding s3fs and boto3 (pip install --target)")
    result = main(["--lab", "--storage", "s3", "--quick", "--lab-reps", "1"])
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last == json.loads(json.dumps(result)) and last["bench"] == "checkpoint_lab_s3"
    assert last["s3_save_ratio_vs_fsspec"] > 0 and last["s3_load_ratio_vs_fsspec"] > 0
    assert last["loads_equal"]
    row = last["per_rate"]["200"]["replicated"]
    # the bytes crossed the storage links (interface counters): every node received the
    # whole model on each load; ours sent a fair share from every node, stock's busiest more
    model = last["model_mb"]
    for variant in S3_VARIANTS:
        assert all(mb >= model for mb in row[variant]["storage_received_mb_per_rank"])
        assert sum(row[variant]["storage_sent_mb_per_rank"]) >= model
    ours = row["ours"]["storage_sent_mb_per_rank"]
    assert max(ours) / (sum(ours) / 4) < 1.15
    assert max(row["fsspec"]["storage_sent_mb_per_rank"]) > 1.2 * max(ours)
