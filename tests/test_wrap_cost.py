"""The step-cost model: its formula by hand, its calibration, and its effect on plans."""

from __future__ import annotations

import pytest
import torch

import fsdp_ext
from benchmarks.wrap_models import FineMoE, FineMoEConfig
from fsdp_ext.testing import run_distributed
from fsdp_ext.wrap.cost import CostModel, calibrate_cost_model


def test_step_cost_by_hand():
    lat, per_byte, hook = 1e-3, 1e-6, 5e-3
    model = CostModel(latency_s=lat, seconds_per_byte=per_byte, hook_s=hook)
    # Root 100 B, unit a 40 B resharded after forward, unit b 60 B kept; world 2 moves
    # half of each unit's bytes per collective.
    got = model.step_s([100, 40, 60], [False, True, False], 2)
    root = hook + 2 * (lat + 50 * per_byte)  # one all-gather, one reduce-scatter
    a = hook + 3 * (lat + 20 * per_byte)  # gathered in forward and backward
    b = hook + 2 * (lat + 30 * per_byte)  # gathered once
    assert got == pytest.approx(root + a + b, rel=1e-12)
    # Full overlap hides every prefetched all-gather: backward ones (a's), and forward
    # ones after the first unit (b's).
    hidden = CostModel(latency_s=lat, seconds_per_byte=per_byte, hook_s=hook, overlap=1.0)
    got = hidden.step_s([100, 40, 60], [False, True, False], 2, forward_prefetch=1)
    assert got == pytest.approx(
        root + (hook + 2 * (lat + 20 * per_byte)) + (hook + lat + 30 * per_byte)
    )


@pytest.mark.parametrize(
    "bad",
    [{"latency_s": -1.0}, {"hook_s": "1"}, {"overlap": 1.5}, {"seconds_per_byte": True}],
)
def test_cost_model_rejects_bad_constants(bad):
    with pytest.raises(ValueError, match="CostModel"):
        CostModel(**bad)
    with pytest.raises(TypeError, match="cost_model"):
        fsdp_ext.GranularityPolicy(memory_budget_bytes=10, cost_model="fast")


def test_overlap_makes_prefetch_worth_its_memory():
    """With gloo's zero overlap prefetch costs memory and saves nothing, so the plan turns
    it off; with NCCL-like overlap and room for it, the plan keeps backward prefetch."""
    with torch.device("meta"):
        model = FineMoE(FineMoEConfig(n_layers=4, num_experts=4))
    layer = sum(p.numel() * 4 for p in model.layers[0].parameters())
    budget = int(4 * layer)
    cpu = fsdp_ext.plan_units(model, fsdp_ext.GranularityPolicy(memory_budget_bytes=budget))
    gpu = fsdp_ext.plan_units(
        model,
        fsdp_ext.GranularityPolicy(
            memory_budget_bytes=budget, cost_model=CostModel(overlap=0.9, source="test")
        ),
    )
    assert cpu.backward_prefetch == 0 and cpu.forward_prefetch == 0
    assert gpu.backward_prefetch == 1 or gpu.forward_prefetch == 1
    assert cpu.peak_bytes <= budget and gpu.peak_bytes <= budget
    assert "source='test'" in str(gpu)


def _calibrate() -> CostModel:
    return calibrate_cost_model(repeats=3)


@pytest.mark.slow
def test_calibration_measures_positive_constants_on_gloo():
    models = run_distributed(_calibrate, 2, timeout=120)
    for model in models:
        assert model.latency_s > 0 and model.seconds_per_byte > 0 and model.hook_s >= 0
        assert model.overlap == 0.0
        assert model.source == "calibrated (gloo, world 2, cpu)"
