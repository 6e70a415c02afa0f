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
    # steps of 1 s; a save called at 4.0 returns at 4.1, its write runs until 6.5, so the
    # steps starting at 4.1, 5.1 and 6.1 run during it (2 s each); the rest are clean
    steps = [(0.0, 1.0, "warmup")] + [(t, t + 1.0, "clean") for t in (1.0, 2.0, 3.0)]
    steps += [(4.1, 6.1, "run"), (6.1, 8.1, "run"), (8.1, 9.1, "run"), (9.1, 10.1, "run")]
    row = summarize_writer("ours_async", _run([(4.0, 4.1, 6.5)], steps, lock=0.005))
    assert row["blocked_ms"] == pytest.approx(115.0)  # the slowest rank, its lock wait too
    assert row["background_s"] == pytest.approx(2.4)  # from rank 0's return (the slowest)
    assert row["steps_during_write"] == 2 and row["steps_clean"] == 5
    assert row["step_slowdown"] == pytest.approx(2.0)
    assert row["staging_over_state"] == pytest.approx(1.1)  # (50 + 60) MB over 100 MB
    assert row["first_save_blocked_ms"] == 500.0
    sync = summarize_writer("stock_sync", _run([(4.0, 6.0, 6.0)], steps))
    assert sync["step_slowdown"] is None and sync["background_s"] == pytest.approx(0.0)


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
