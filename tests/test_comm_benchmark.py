"""Smoke test of benchmarks/comm.py: a tiny model, two steps per mode, real ranks."""

from dataclasses import replace

from benchmarks.comm import MODES, run, summarize
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


def test_benchmark_measures_every_mode():
    runs = run(2, replace(TINY), seeds=[0])
    summary = summarize(runs)
    assert set(summary["runs"]) == set(MODES)
    wire = {m: runs[m][0]["wire_bytes_per_step"] for m in MODES}
    assert all(w > 0 for w in wire.values())
    assert wire["q4"] == wire["loco"] < wire["default"] / 3
    # the counted bytes agree with what LoCo itself recorded at its call site
    assert runs["loco"][0]["comm_stats"]["bytes_sent"] == wire["loco"] * TINY.steps
    assert runs["default"][0]["comm_stats"] is None
    assert 0 < summary["bytes_ratio_loco_vs_fp32"] < 0.3
