"""benchmarks/checkpoint_stall.py: its arithmetic on made-up timelines (default run), and
``--quick`` end to end on real ranks (slow: six writers, each in fresh processes)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.checkpoint_stall import (
    METRICS,
    REPORTED,
    _parser,
    check_args,
    lab_worker_argv,
    lab_writers,
    summarize,
    summarize_writer,
    torch_checkpointing_missing,
)

REPO = Path(__file__).resolve().parent.parent
MB = 1 << 20


def _run(saves, steps, *, state=100 * MB, growth=(50 * MB, 60 * MB), lock=0.0):
    """Two ranks with the same timeline; rank 1 blocks 10 ms longer on every save."""

    def timeline(extra):
        return {
            "state_bytes": state // 2,
            "staging_bytes": None,
            "steps": [{"start": a, "end": b, "s": b - a, "phase": p} for a, b, p in steps],
            "saves": [
                {"step": i, "call": c, "ret": r + extra, "done": d, "lock": lock}
                for i, (c, r, d) in enumerate(saves)
            ],
            "first_save": {"call": 0.0, "ret": 0.5, "done": 0.5, "lock": 0.0},
        }

    return {
        "timelines": [timeline(0.0), timeline(0.01)],
        "base_rss": [400 * MB, 400 * MB],
        "clean_hwm": [500 * MB, 500 * MB],
        "end_hwm": [500 * MB + growth[0], 500 * MB + growth[1]],
        "helpers": [[], []],
    }


def test_per_save_figures_and_step_slowdown():
    # a save called at 4.0 returns at 4.1, its write runs until 6.5, so the steps starting
    # at 4.1 and 6.1 run during it (2 s each); the timed part's later steps take 1 s and the
    # clean phase's 0.5 s (the machine was faster then): the control is the timed part's own
    steps = [(0.0, 1.0, "warmup")] + [(t, t + 0.5, "clean") for t in (1.0, 1.5, 2.0)]
    steps += [(4.1, 6.1, "run"), (6.1, 8.1, "run"), (8.1, 9.1, "run"), (9.1, 10.1, "run")]
    row = summarize_writer("ours_async", _run([(4.0, 4.1, 6.5)], steps, lock=0.005))
    assert row["blocked_ms"] == pytest.approx(115.0)  # the slowest rank, its lock wait too
    assert row["background_s"] == pytest.approx(2.4)  # from rank 0's return (the slowest)
    assert row["steps_during_write"] == 2 and row["steps_clean"] == 2
    assert row["step_slowdown"] == pytest.approx(2.0)  # 4.0 against the clean phase
    assert row["step_ms_lost_per_save"] == pytest.approx(2000.0)  # 2 steps 1 s over, 1 save
    assert row["step_ms_clean"] == 1000.0 and row["step_ms_clean_phase"] == 500.0
    assert row["staging_over_state"] == pytest.approx(1.1)  # (50 + 60) MB over 100 MB
    assert row["first_save_blocked_ms"] == 500.0
    sync = summarize_writer("stock_sync", _run([(4.0, 6.0, 6.0)], steps))
    assert sync["step_slowdown"] is None and sync["background_s"] == pytest.approx(0.0)
    assert sync["step_ms_lost_per_save"] is None


def test_summary_picks_the_better_stock_async_mode_and_states_targets():
    row = {"blocked_ms": 100.0, "background_s": 1.0, "step_slowdown": 1.05}
    rows = {
        "stock_sync": {**row, "blocked_ms": 2000.0, "step_slowdown": None},
        "stock_async_thread": {**row, "blocked_ms": 400.0},
        "stock_async_process": {**row, "blocked_ms": 300.0},
        "ours_sync": {**row, "blocked_ms": 1900.0},
        "ours_async": {**row, "staging_over_state": 1.05, "staging_bytes_over_state": 1.0},
    }
    skipped = {"torch_checkpointing": "not installed"}
    out = summarize(rows, skipped, {"world": 2})
    assert out["stock_async_mode"] == "process"
    assert out["blocked_ms_stock_async"] == 300.0
    assert out["blocked_ours_async_over_stock_async"] == pytest.approx(1 / 3, abs=1e-3)
    assert out["blocked_ours_async_over_stock_sync"] == 0.05
    for writer in REPORTED:
        for metric in METRICS:
            assert f"{metric}_{writer}" in out
    assert out["blocked_ms_torch_checkpointing"] is None and out["skipped"] == skipped
    assert out["targets_met"] == {
        "blocked_ours_async_over_stock_async": True,
        "blocked_ours_async_over_stock_sync": True,
        "step_slowdown_ours_async": True,
        "staging_over_state_ours_async": True,
    }


@pytest.mark.slow  # six writers, each in two fresh rank processes: minutes on two cores
def test_quick_benchmark_prints_every_writer(tmp_path):
    plot = tmp_path / "stall.png"
    script = REPO / "benchmarks" / "checkpoint_stall.py"
    proc = subprocess.run(
        [sys.executable, str(script), "--quick", "--plot", str(plot), "--dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=1800,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["benchmark"] == "checkpoint_stall" and out["quick"]
    missing = torch_checkpointing_missing()
    for writer in REPORTED:
        for metric in METRICS:
            assert f"{metric}_{writer}" in out
        if writer == "torch_checkpointing" and missing is not None:
            assert "torch_checkpointing" in out["skipped"]
            continue
        assert out[f"blocked_ms_{writer}"] > 0
        assert out[f"staging_over_state_{writer}"] is not None
    for writer in ("stock_async", "ours_async"):
        assert out[f"background_s_{writer}"] > 0
    assert out["blocked_ours_async_over_stock_sync"] is not None
    assert out["staging_bytes_over_state_ours_async"] == pytest.approx(1.0, abs=0.05)
    assert plot.stat().st_size > 0
    assert list(tmp_path.iterdir()) == [plot]  # the checkpoints went with their temp dir


def _args(argv):
    parser = _parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    return args


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--storage", "s3"], "--storage: only with --lab"),
        (["--lab-link", "100"], "--lab-link: only with --lab"),
        (["--lab-storage-nice", "0"], "--lab-storage-nice: only with --lab"),
        (["--lab", "--lab-storage-nice", "20"], "--lab-storage-nice: invalid choice: 20"),
        (["--lab", "--dir", "/tmp/x"], "--dir: with --lab"),
        (["--lab", "--lab-link", "0"], "--lab-link: a rate in Mbit/s > 0"),
        (["--lab", "--lab-fabric", "-5"], "--lab-fabric: a rate in Mbit/s > 0"),
        (["--lab", "--plot", "x.png"], "--plot and --raw are not kept with --lab"),
        (["--lab", "--storage", "nfs"], "invalid choice: 'nfs'"),
        (["--plot", ""], "--plot: a .png file name (leave the flag out for none), got '.'"),
    ],
)
def test_lab_arguments_that_do_not_fit_are_refused(argv, says, capsys):
    with pytest.raises(SystemExit) as exc:
        _args(argv)
    assert exc.value.code == 2
    assert says in capsys.readouterr().err


def test_lab_arguments_reach_every_node_and_writers_that_cannot_run_are_named():
    args = _args(["--lab", "--quick", "--lab-link", "100", "--threads", "2"])
    assert args.storage == "sshfs" and args.lab_link == 100 and args.lab_fabric == 1000
    argv = lab_worker_argv("ours_async", "/shared/stall-ours_async", {"dim": 64, "every": 2}, args)
    assert argv[0].endswith("checkpoint_stall.py")
    flags = " ".join(argv[1:])
    assert "--worker ours_async --lab-worker --dir /shared/stall-ours_async" in flags
    assert "--threads 2 --storage sshfs --dim 64 --every 2" in flags
    s3 = _args(["--lab", "--storage", "s3", "--s3fs-path", "/opt/s3fs"])
    assert "--s3fs-path /opt/s3fs" in " ".join(lab_worker_argv("stock_sync", "s3://lab/x", {}, s3))
    everyone = ["stock_sync", "stock_async_thread", "torch_checkpointing", "ours_async"]
    assert lab_writers(everyone, "sshfs", None) == {}
    on_s3 = lab_writers(everyone, "s3", None)
    assert set(on_s3) == {"stock_sync", "stock_async_thread", "torch_checkpointing"}
    assert "--s3fs-path" in on_s3["stock_sync"]
    assert set(lab_writers(everyone, "s3", "/opt/s3fs")) == {"torch_checkpointing"}


@pytest.mark.slow  # a lab (root, namespaces, sshfs), each writer in a job of its own
@pytest.mark.parametrize("storage", ["sshfs", "s3"])
def test_quick_benchmark_in_the_lab(storage):
    from fsdp_ext.lab import unavailable_reason

    reason = unavailable_reason(storage=storage)
    if reason is not None:
        pytest.skip(f"the lab cannot run here: {reason}")
    script = REPO / "benchmarks" / "checkpoint_stall.py"
    writers = "stock_sync,stock_async_thread,ours_async"
    proc = subprocess.run(
        [sys.executable, str(script), "--quick", "--lab", "--storage", storage,
         "--writers", writers, "--lab-link", "200"],
        capture_output=True,
        text=True,
        timeout=1800,
        cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["lab"]["storage"] == storage and out["lab"]["storage_link_mbit"] == 200
    ran = [w for w in writers.split(",") if w not in out["skipped"]]
    assert "ours_async" in ran
    for writer in ran:
        assert out["writers"][writer]["blocked_ms"] > 0
        assert sum(out["lab"]["storage_sent_mb_per_node"][writer]) > 0  # it went to storage
    assert out["writers"]["ours_async"]["blocked_ms_phases"]["stage"] > 0
