"""benchmarks/zeropp.py: a smoke run, and the bytes every collective carries per step
against the formula of docs/comm.md (the wrapped collectives against FSDP's shard sizes)."""

from dataclasses import replace

import pytest

from benchmarks.zeropp import predicted_bytes, run, summarize
from tests.test_train import TINY


@pytest.mark.slow  # the benchmark end to end (16 s); test_formula_by_hand holds the formula
def test_collective_bytes_match_the_formula_in_both_modes():
    base = replace(TINY, steps=2, qwz_group_size=32)
    runs = run(base, [0], ("fp32", "zeropp", "hpz"))
    summary = summarize(runs, base)
    # hpZ alone moves the backward gathers into the node and changes no bit of training
    assert runs["hpz"][0]["losses"] == runs["fp32"][0]["losses"]
    assert runs["hpz"][0]["val_loss"] == runs["fp32"][0]["val_loss"]
    assert summary["bytes_per_step"]["hpz"]["all_gather_intra"] > 0
    for mode in ("fp32", "zeropp"):
        measured = summary["bytes_per_step"][mode]
        predicted = summary["bytes_per_step_predicted"][mode]
        assert measured == pytest.approx(predicted, rel=0, abs=0), (mode, measured, predicted)
    # what crosses the emulated node boundary: int8 forward gathers and 4-bit gradients
    assert 0 < summary["cross_node_bytes_ratio_zeropp_vs_fp32"] < 0.25
    assert isinstance(summary["val_loss_gap_zeropp"], float)
    # qwZ's own counts agree; they also cover validation (2 batches, not wrapped): the first
    # batch gathers int8 from the shards, the second from hpZ's node copies
    stats, per_step = runs["zeropp"][0]["weight_stats"], summary["bytes_per_step"]["zeropp"]
    assert stats["bytes_sent"] == 3 * per_step["all_gather_inter"]
    assert stats["intra_node_bytes"] == 3 * per_step["all_gather_intra"]


def test_formula_by_hand():
    # one unit of 1000 + 24 elements per rank (two parameters), W = 4, r = 2, group 256
    z = predicted_bytes([([976, 24], False)], "zeropp", 256)
    # 4 groups + 1 group of 256 int8 codes, then their 5 fp32 scales padded to 8 (32 B)
    assert z["all_gather_inter"] == 3 * ((4 + 1) * 256 + 8 * 4)
    z = predicted_bytes([([1000], False)], "zeropp", 256)
    assert z["all_gather_intra"] == 1 * 2 * 4000
    assert z["reduce_scatter_intra"] == 1 * 2 * 4000
    assert z["all_to_all_inter"] == 1 * 8 * 68
    # the root gathers once under fp32 (FSDP keeps it gathered), the others twice
    f = predicted_bytes([([1000], True), ([4, 6], False)], "fp32", 256)
    assert f["all_gather_inter"] == 3 * 4000 + 2 * 3 * 40
    assert f["reduce_scatter_inter"] == 3 * 4040


def test_limit_keys_and_the_node_formula():
    """``--limit``'s JSON: per rate, the step over max(loopback step, link bytes / rate),
    and the link bytes against the per-node formula."""
    from benchmarks.zeropp import limit_keys, node_link_formula

    per_rank = predicted_bytes([([1000], False)], "zeropp", 256)
    # the ring all-gather crosses once per node; both ranks of a node send all-to-all rows
    assert node_link_formula(per_rank) == per_rank["all_gather_inter"] + 2 * 8 * 68
    rows = {
        25: {"step_ms": 660.0, "link_bytes": 1.5e6},
        100: {"step_ms": 330.0, "link_bytes": 1.5e6},
    }
    keys = limit_keys(300.0, rows, 1_500_000)
    # 25 Mbit/s: 1.5 MB take 480 ms > 300 ms of compute; 100 Mbit/s: 120 ms < 300 ms
    assert keys["limit_ms_25"] == 480.0 and keys["zeropp_over_limit_25"] == 1.375
    assert keys["limit_ms_100"] == 300.0 and keys["zeropp_over_limit_100"] == 1.1
    assert keys["link_bytes_vs_formula_rel_err_25"] == 0.0
    assert {"loopback_step_ms", "link_bytes_per_step_formula", "step_ms_25", "link_ms_100"} <= set(
        keys
    )


def test_the_dependency_bound_keeps_each_phase_s_link_time_in_its_phase():
    """The forward's gathers hide only behind the forward (its weights come from the last
    optimizer step), the backward's bytes behind the backward: by hand, 300 ms of loopback
    step of which 100 ms forward; 1.5 MB on the link per step, 1.0 MB of it in the forward."""
    from benchmarks.zeropp import dependency_bound_ms, limit_keys

    rows = {
        25: {"step_ms": 660.0, "link_bytes": 1.5e6, "forward_link_bytes": 1.0e6},
        100: {"step_ms": 330.0, "link_bytes": 1.5e6, "forward_link_bytes": 1.0e6},
    }
    keys = limit_keys(300.0, rows, 1_500_000, loopback_forward_ms=100.0)
    # 25 Mbit/s: forward max(100, 320) + the rest max(200, 160) = 520 ms; the pooled limit
    # max(300, 480) = 480 ms would call a step of 520 ms 8 % slow when it is at its bound
    assert keys["forward_link_ms_25"] == 320.0
    assert keys["dependency_bound_ms_25"] == 520.0
    assert keys["zeropp_over_dependency_bound_25"] == round(660 / 520, 4)
    assert keys["limit_ms_25"] == 480.0
    # 100 Mbit/s: both phases' link time under their compute: the bound is the loopback step
    assert keys["dependency_bound_ms_100"] == 300.0 == keys["limit_ms_100"]
    assert keys["loopback_forward_ms"] == 100.0
    # the backward's link time is what the forward's does not take; compute bounds each phase
    assert dependency_bound_ms(300.0, 100.0, 480.0, 40.0) == 100.0 + 440.0
    assert dependency_bound_ms(300.0, 100.0, 0.0, 0.0) == 300.0
    # without the forward's figures, no bound is claimed
    assert not any("dependency" in k for k in limit_keys(300.0, rows, 1_500_000))


def test_the_rank_program_splits_each_step_at_the_forward_s_end():
    """cluster_rank's running totals: the forward's time and link bytes from the snapshot
    taken when the model's forward returned, summed over steps; only a node's lead reads
    the link."""
    from benchmarks.cluster import forward_intervals_ms
    from benchmarks.cluster_rank import KINDS, _advance

    def snap(t, tx):
        link = None if tx is None else {"tx": tx, "rx": 0}
        return {"t": t, "cpu": t, "link": link, "cross": dict.fromkeys(KINDS, 0)}

    total = {**snap(0.0, 0), "fwd_t": 0.0, "fwd_tx": 0}
    steps = []
    for k, (fwd, rest, fwd_tx, tx) in enumerate([(0.2, 0.5, 700, 900), (0.3, 0.4, 600, 1000)]):
        t0 = 10.0 * k
        total = _advance(
            total,
            snap(t0, 5000 * k),
            snap(t0 + fwd + rest, 5000 * k + tx),
            snap(t0 + fwd, 5000 * k + fwd_tx),
        )
        steps.append(total)
    assert steps[-1]["t"] == pytest.approx(1.4) and steps[-1]["fwd_t"] == pytest.approx(0.5)
    assert steps[-1]["fwd_tx"] == 1300 and steps[-1]["link"]["tx"] == 1900
    assert forward_intervals_ms(steps, 0) == [pytest.approx(300.0)]
    # a rank that is not its node's lead has no link counters, and no forward bytes
    other = _advance(snap(0.0, None), snap(0.0, None), snap(1.0, None), snap(0.25, None))
    assert other["fwd_t"] == 0.25 and "fwd_tx" not in other


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--rates", "25"], "--rates: only with --limit"),
        (["--blocking"], "--blocking: only with --limit"),
        (["--limit", "--rates", "25", "0"], "rates must be positive"),
        (["--limit", "--steps", "3"], "needs at least --warmup"),
    ],
)
def test_limit_argument_errors(argv, needle, capsys):
    """Bad ``--limit`` arguments stop before anything runs, naming the argument."""
    from benchmarks.zeropp import main

    with pytest.raises(SystemExit):
        main(argv)
    assert needle in capsys.readouterr().err
