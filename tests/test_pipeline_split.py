"""split_stages: balance against brute force, fqns kept, stages compose to the model."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from examples.model import ModelConfig, Transformer
from fsdp_ext import plan_stages, split_stages
from fsdp_ext.pipeline.split import balanced_bounds


def _brute_force_max(costs, k, first, last):
    """The optimal max stage cost over every contiguous split (independent of the DP)."""
    n, best = len(costs), float("inf")
    for cuts in itertools.combinations(range(1, n), k - 1):
        edges = (0, *cuts, n)
        stage = [sum(costs[a:b]) for a, b in itertools.pairwise(edges)]
        stage[0] += first
        stage[-1] += last
        best = min(best, max(stage))
    return best


@settings(max_examples=150, deadline=None)
@given(
    costs=st.lists(st.integers(0, 100), min_size=1, max_size=9),
    k=st.integers(1, 5),
    first=st.integers(0, 150),
    last=st.integers(0, 150),
)
def test_balanced_bounds_is_optimal_contiguous_split(costs, k, first, last):
    k = min(k, len(costs))
    bounds = balanced_bounds([float(c) for c in costs], k, float(first), float(last))
    # contiguous, covering, non-empty
    assert bounds[0][0] == 0 and bounds[-1][1] == len(costs)
    assert all(a < b for a, b in bounds)
    assert all(b == a2 for (_, b), (a2, _) in itertools.pairwise(bounds))
    stage = [sum(costs[a:b]) for a, b in bounds]
    stage[0] += first
    stage[-1] += last
    optimum = _brute_force_max(costs, k, first, last)
    assert max(stage) <= optimum + max(costs)  # the bound: within one block
    assert max(stage) == optimum  # and in fact exact


def _model(n_layers=6, num_experts=0):
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=64,
        dim=32,
        n_layers=n_layers,
        n_heads=2,
        hidden_dim=64,
        max_seq_len=8,
        num_experts=num_experts,
        moe_hidden_dim=16,
    )
    return Transformer(cfg)


def test_stages_keep_fqns_and_compose_to_the_model(capsys):
    model = _model()
    stages = split_stages(model, 3)
    table = capsys.readouterr().out
    assert "stage split: 3 stages over 6 blocks of layers" in table
    full = model.state_dict()
    keys = [set(s.state_dict()) for s in stages]
    assert set().union(*keys) == set(full)
    assert sum(len(k) for k in keys) == len(full)  # a partition
    for s in stages:
        for k, v in s.state_dict().items():
            assert v.data_ptr() == full[k].data_ptr()  # shared, not copied
    assert "tok_embeddings.weight" in keys[0] and "output.weight" in keys[-1]
    x = torch.randint(0, 64, (2, 8))
    h = x
    for s in stages:
        h = s(h)
    torch.testing.assert_close(h, model(x), rtol=0, atol=0)


def test_cost_callable_and_plan_table():
    model = _model(n_layers=4)
    # all cost on block 0: it must sit alone in stage 0
    plan = plan_stages(model, 2, cost=lambda m: 1000.0 if m is model.layers[0] else 1.0)
    assert plan.bounds == ((0, 1), (1, 4))
    assert "extras" in str(plan)


def test_sequential_and_moduledict_keep_keys():
    seq = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.Linear(4, 2))
    stages = split_stages(seq, 2, verbose=False)
    assert [list(s.state_dict()) for s in stages][1][-1] == "3.bias"
    x = torch.randn(3, 4)
    torch.testing.assert_close(stages[1](stages[0](x)), seq(x))

    class Dict(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleDict({f"b{i}": nn.Linear(4, 4) for i in range(3)})
            self.head = nn.Linear(4, 1)

    stages = split_stages(Dict(), 3, verbose=False)
    assert list(stages[2].state_dict()) == [
        "blocks.b2.weight",
        "blocks.b2.bias",
        "head.weight",
        "head.bias",
    ]


def test_bad_arguments():
    model = _model(n_layers=2)
    with pytest.raises(ValueError, match="num_stages"):
        split_stages(model, 3, verbose=False)
    with pytest.raises(ValueError, match="num_stages"):
        split_stages(model, 0, verbose=False)
    with pytest.raises(ValueError, match="cost"):
        split_stages(model, 2, cost="flops", verbose=False)
    model.output.weight = model.tok_embeddings.weight
    with pytest.raises(ValueError, match="tied"):
        split_stages(model, 2, verbose=False)
    with pytest.raises(ValueError, match="ModuleList"):
        split_stages(nn.Linear(2, 2), 1, verbose=False)


class _RootScaled(nn.Module):
    """Four blocks of 100 parameters, and 300 held by the model itself."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.rand(300))
        self.blocks = nn.ModuleList(nn.Linear(10, 10, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.scale is not None:  # a stage without the root parameters skips them
            x = x * self.scale[:10]
        for block in self.blocks:
            x = block(x)
        return x


def test_root_parameters_go_with_the_first_stage_and_count_there():
    model = _RootScaled()
    plan = plan_stages(model, 2)
    stages = split_stages(model, 2, verbose=False)
    held = [sum(p.numel() for p in s.parameters()) for s in stages]
    # every parameter in exactly one stage, the root's in the first
    assert sum(held) == sum(p.numel() for p in model.parameters())
    assert "scale" in dict(stages[0].named_parameters())
    # the plan costs what each stage holds, and its split is the optimum of those costs
    assert plan.costs == tuple(float(h) for h in held)
    assert max(held) == _brute_force_max([100] * 4, 2, 300, 0) == 400
    assert plan.bounds == ((0, 1), (1, 4))
    x = torch.randn(3, 10)
    torch.testing.assert_close(stages[1](stages[0](x)), model(x), rtol=0, atol=0)
