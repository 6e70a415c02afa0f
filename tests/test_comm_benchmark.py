"""benchmarks/comm.py: a smoke run on real ranks, and the metrics checked by hand."""

import json
import math
from dataclasses import replace

import numpy as np
import pytest
import torch

from benchmarks.comm import (
    MODES,
    fidelity,
    hook_times,
    main,
    regime_summary,
    run,
    step_times,
    summarize,
)
from benchmarks.comm_fidelity import FidelityTracker, mean_and_stderr
from examples.model import ModelConfig
from examples.train import TrainConfig

TINY = TrainConfig(
    steps=2,
    batch_size=4,
    seq_len=32,
    model=ModelConfig(dim=32, n_layers=1, n_heads=2, hidden_dim=64, max_seq_len=32),
    warmup_steps=1,
    val_batches=1,
    verbose=False,
    log_every=10**9,
)


@pytest.mark.slow  # the benchmark end to end
def test_benchmark_measures_every_mode_and_fidelity():
    runs = run(2, replace(TINY), seeds=[0])
    summary = summarize(runs)
    assert set(summary["runs"]) == set(MODES)
    wire = {m: runs[m][0]["wire_bytes_per_step"] for m in MODES}
    assert all(w > 0 for w in wire.values())
    assert wire["q4"] == wire["loco"] < wire["stock"] / 3
    # the counted bytes agree with what LoCo itself recorded at its call site, but for
    # shard_moe_model's one-off divide-factor probe (a reduce-scatter of a few elements)
    probe_bytes = wire["loco"] * TINY.steps - runs["loco"][0]["comm_stats"]["bytes_sent"]
    assert 0 <= probe_bytes <= 64
    assert runs["stock"][0]["comm_stats"] is None
    assert 0 < summary["bytes_ratio_loco_vs_fp32"] < 0.3

    # On the exact trajectory the shadow comm hands FSDP what the stock reduce-scatter does.
    out = fidelity(2, replace(TINY, steps=3), 128, deliver="exact", window=2)
    assert out["losses"][:2] == runs["stock"][0]["losses"]
    for method in ("q4", "loco"):
        s = out["summary"][method]
        # 4-bit absmax loses a few percent of each step's gradient, never all of it
        assert 0.005 < s["step_rel_err"] < 0.5
        assert 0.9 < s["step_cosine"] < 1
        assert 0 < s["running_sum_3_rel_err"] < 0.5
    # step 1: LoCo's error buffer starts at zero, so it sends exactly what q4 sends
    first = {m: out["curves"][m]["step"]["rel_err"][0] for m in ("q4", "loco")}
    assert first["q4"] == first["loco"]


def _hand_metrics(exact: np.ndarray, delivered: np.ndarray, window: int):
    """exact, delivered: [steps, n] whole gradients. Independent numpy re-derivation."""

    def rel(d, g):
        return np.linalg.norm(d - g) / np.linalg.norm(g)

    def cos(d, g):
        return d @ g / (np.linalg.norm(d) * np.linalg.norm(g))

    steps = len(exact)
    ends = range(window - 1, steps, window)
    windows = [
        (exact[t + 1 - window : t + 1].sum(0), delivered[t + 1 - window : t + 1].sum(0))
        for t in ends
    ]
    return {
        "step_rel_err": np.mean([rel(d, g) for d, g in zip(delivered, exact, strict=True)]),
        "step_cosine": np.mean([cos(d, g) for d, g in zip(delivered, exact, strict=True)]),
        f"running_sum_{steps}_rel_err": rel(delivered.sum(0), exact.sum(0)),
        f"running_sum_{steps}_cosine": cos(delivered.sum(0), exact.sum(0)),
        f"running_sum_{window}_rel_err": np.mean([rel(d, g) for g, d in windows]),
        f"running_sum_{window}_cosine": np.mean([cos(d, g) for g, d in windows]),
        "cumulative": [rel(delivered[: t + 1].sum(0), exact[: t + 1].sum(0)) for t in range(steps)],
    }


def test_fidelity_tracker_matches_a_hand_computation():
    """Two units of different sizes, six steps, windows of two: every metric by hand."""
    steps, window, sizes = 6, 2, (5, 3)
    gen = np.random.default_rng(0)
    exact = gen.normal(size=(steps, sum(sizes))) + 0.5  # a shared drift, as in training
    noisy = exact + 0.3 * gen.normal(size=exact.shape)
    biased = exact * 0.9
    tracker = FidelityTracker(("noisy", "biased"), steps, window)
    for t in range(steps):
        for unit, (lo, hi) in enumerate(((0, sizes[0]), (sizes[0], sum(sizes)))):
            tracker.add(
                unit,
                torch.tensor(exact[t, lo:hi], dtype=torch.float32),
                {
                    "noisy": torch.tensor(noisy[t, lo:hi], dtype=torch.float32),
                    "biased": torch.tensor(biased[t, lo:hi], dtype=torch.float32),
                },
            )
    exact32 = exact.astype(np.float32).astype(np.float64)
    for name, delivered in (("noisy", noisy), ("biased", biased)):
        hand = _hand_metrics(exact32, delivered.astype(np.float32).astype(np.float64), window)
        got = tracker.summary(name)
        for key, value in got.items():
            assert value == pytest.approx(hand[key], rel=1e-9), key
        cumulative = tracker.curves(name, "cumulative")["rel_err"]
        assert cumulative == pytest.approx(hand["cumulative"], rel=1e-9)
    # a constant 10 % shrink is a 10 % error of every sum, and a cosine of exactly 1
    assert tracker.summary("biased")["running_sum_6_rel_err"] == pytest.approx(0.1, rel=1e-6)
    assert tracker.summary("biased")["running_sum_6_cosine"] == pytest.approx(1.0, abs=1e-12)
    with pytest.raises(RuntimeError, match="more than steps"):
        tracker.add(0, torch.zeros(5), {"noisy": torch.zeros(5), "biased": torch.zeros(5)})


def test_mean_and_stderr_and_regime_verdict():
    mean, se = mean_and_stderr([1.0, 2.0, 6.0])
    assert mean == 3.0
    assert se == pytest.approx(math.sqrt(((4 + 1 + 9) / 2) / 3))
    assert math.isnan(mean_and_stderr([2.0])[1])
    with pytest.raises(ValueError, match="values"):
        mean_and_stderr([])

    def runs(q4, loco):
        base = [{"val_loss": 2.0}] * len(q4)
        return {
            "stock": base,
            "q4": [{"val_loss": 2.0 * (1 + g)} for g in q4],
            "loco": [{"val_loss": 2.0 * (1 + g)} for g in loco],
        }

    clear = regime_summary(runs([0.05, 0.06, 0.07], [0.0, 0.01, 0.005]), "q4", "loco", {})
    assert clear["q4_gap"] == pytest.approx(0.06)
    assert clear["q4_gap_se"] == pytest.approx(0.01 / math.sqrt(3), rel=1e-3)
    assert clear["q4_degrades"] and clear["loco_gap_at_most_half_of_q4"]
    assert clear["loco_minus_q4"] == pytest.approx(-0.055)
    assert clear["loco_minus_q4_se"] == pytest.approx(0.005, rel=1e-3)
    # a tie within the noise is reported as one
    tie = regime_summary(runs([0.05, -0.04, 0.01], [0.0, 0.02, -0.01]), "q4", "loco", {})
    assert not tie["q4_degrades"] and not tie["loco_gap_at_most_half_of_q4"]


@pytest.mark.slow  # three short training runs of the example model
def test_regime_only_reports_the_low_lr_regime(capsys):
    result = main(["--quick", "--regime-only", "--steps", "3"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == result
    regime = result["degradation_regime"]
    assert regime["config"] == {"group_size": 4096, "world_size": 2, "steps": 3, "lr": 3e-4}
    assert regime["seeds"] == 1 and len(regime["q4_gap_per_seed"]) == 1


@pytest.mark.slow  # two short jobs of three models each
def test_step_time_smoke():
    """The step-time mode on a tiny model: every mode, both codec backends."""
    steps = step_times(replace(TINY, steps=5), [2], backends=["cpu", "reference"])
    for backend in ("cpu", "reference"):
        row = steps[backend]["2"]
        assert all(row[m]["step_ms"] > 0 and row[m]["step_cpu_ms"] > 0 for m in MODES)
        assert row["loco_vs_q4"] == round(row["loco"]["step_ms"] / row["q4"]["step_ms"], 4)


def test_hook_time_smoke():
    hooks = hook_times(1024, 2, ["cpu"])
    assert set(hooks["cpu"]) == set(MODES) and all(ms > 0 for ms in hooks["cpu"].values())
