"""benchmarks/chaos.py: its schedule, its judgement of the end state, and (slow) a quick run.

The default run checks the two pure pieces in well under a second: the schedule (seeded,
long enough, every kind of fault, node 0 lost once, a load-kill only after a restart) and the
comparison of the final states, which must see one ulp in one optimizer moment even when
every logged loss agrees. The slow run builds the 3 x 2 lab and runs ``--quick``.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from benchmarks.chaos_schedule import KINDS, RESTARTING, schedule
from benchmarks.chaos_state import RunEnd, compare_runs, same_bits


def test_the_schedule_is_seeded_long_and_covers_every_kind():
    full = schedule(0, 200, 12, ckpt_every=10)
    assert full == schedule(0, 200, 12, ckpt_every=10)
    assert full != schedule(1, 200, 12, ckpt_every=10)
    for seed in range(20):
        faults = schedule(seed, 200, 12, ckpt_every=10)
        assert len(faults) >= 10
        assert {f.kind for f in faults} == set(KINDS), seed
        assert any(f.kind == "node-loss" and f.target == 0 for f in faults), seed
        steps = [f.step for f in faults if f.step is not None]
        assert steps == sorted(set(steps)) and steps[0] >= 10 and steps[-1] < 200, seed
        for before, fault in itertools.pairwise(faults):
            if fault.kind == "load-kill":  # struck on the "resuming:" of a restart
                assert before.kind in RESTARTING and fault.step is None, seed
        assert all(f.step % 10 == 0 for f in faults if f.kind == "save-kill"), seed
        assert all(0 <= f.target < 6 for f in faults if f.kind == "rank-kill")
        assert all(0 <= f.target < 3 for f in faults if f.kind != "rank-kill")
    assert faults[0].kind != "load-kill"


def test_the_quick_schedule_has_four_faults_or_more():
    quick = schedule(0, 50, 5, ckpt_every=5)
    assert len(quick) >= 4
    assert {"node-loss", "load-kill", "save-kill"} <= {f.kind for f in quick}


def test_too_few_steps_for_the_faults_is_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"too few for 10 faults.*pass at least"):
        schedule(0, 40, 11, ckpt_every=10)


def _state(seed: int = 0) -> dict[str, object]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "model.layers.0.attention.wo.weight": torch.randn(4, 4, generator=gen),
        "model.state.layers.0.attention.wo.weight.exp_avg": torch.randn(4, 4, generator=gen),
        "model.state.layers.0.attention.wo.weight.exp_avg_sq": torch.rand(4, 4, generator=gen),
        "model.state.layers.0.attention.wo.weight.step": torch.tensor(200.0),
        "model.param_groups.layers.0.attention.wo.weight.lr": 3e-4,
        "rng.rank0.cpu": torch.zeros(8, dtype=torch.uint8),
    }


def test_one_ulp_in_one_optimizer_moment_is_not_the_same_end():
    """The acceptance mutant "comparing only losses, not state": every loss agrees, the
    model agrees, one element of one Adam moment is one ulp off."""
    losses = {step: 5.0 - step / 100 for step in range(1, 51)}
    reference = RunEnd(dict(losses), _state())
    same = compare_runs(RunEnd(dict(losses), _state()), reference)
    assert same["final_state_equal"] and same["model_equal"] and same["optimizer_equal"]

    nudged = _state()
    moment = nudged["model.state.layers.0.attention.wo.weight.exp_avg_sq"]
    moment[2, 3] = torch.nextafter(moment[2, 3], torch.tensor(1.0))
    verdict = compare_runs(RunEnd(dict(losses), nudged), reference)
    assert verdict["losses_equal"] and verdict["model_equal"]
    assert not verdict["optimizer_equal"]
    assert verdict["final_state_equal"] is False
    assert verdict["differing"] == {
        "optimizer": ["model.state.layers.0.attention.wo.weight.exp_avg_sq"]
    }


def test_a_missing_or_empty_state_is_never_equal():
    losses = {1: 5.0}
    assert not compare_runs(RunEnd(losses, {}), RunEnd(losses, {}))["final_state_equal"]
    half = {k: v for k, v in _state().items() if ".state." not in k}
    assert not compare_runs(RunEnd(losses, half), RunEnd(losses, _state()))["final_state_equal"]


def test_bits_not_values():
    assert not same_bits(torch.tensor([0.0]), torch.tensor([-0.0]))
    assert same_bits(torch.tensor([float("nan")]), torch.tensor([float("nan")]))
    assert not same_bits(torch.tensor([1.0]), torch.tensor([1.0], dtype=torch.float64))


@pytest.mark.slow  # two lab jobs of 50 steps, 5 faults: about 7 minutes on the loaded machine
def test_chaos_quick_ends_bit_for_bit_without_hangs():
    from benchmarks.chaos import main
    from fsdp_ext.lab.cleanup import lab_runs
    from fsdp_ext.lab.rendezvous import etcd_missing
    from tests.lab_helpers import require_lab

    require_lab()
    if etcd_missing():
        pytest.skip(f"the chaos lab needs {', '.join(etcd_missing())}")
    before = set(lab_runs())
    out = main(["--quick"])
    assert out["finished"], out
    assert out["faults"] >= 4 and out["faults"] == out["faults_scheduled"], out
    assert out["hangs"] == 0, out
    assert out["restarts"] >= 2, out
    assert out["final_state_equal"] is True, out
    assert out["checkpoints_lost_or_corrupt"] == 0, out
    assert out["world_at_end"] == 6, out
    assert 0 < out["goodput_over_fault_free"] <= 1.1, out
    assert len(out["lost_steps"]) == out["faults"], out
    assert set(lab_runs()) <= before  # the lab took everything it built away
