"""clip_grad_norm_ over gradients on different meshes equals the single-process norm."""

import math

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from fsdp_ext import clip_grad_norm_
from fsdp_ext.testing import run_distributed

NORM_TYPES = [2.0, 1.0, 3.0, math.inf]


def _params(*grads):
    params = []
    for g in grads:
        p = torch.nn.Parameter(torch.zeros_like(g))
        p.grad = g.clone()
        params.append(p)
    return params


@pytest.mark.parametrize("norm_type", NORM_TYPES)
@pytest.mark.parametrize("max_norm", [0.1, 1e6])
def test_plain_tensors_match_torch(norm_type, max_norm):
    torch.manual_seed(0)
    grads = [torch.randn(5, 3), torch.randn(7) * 10, torch.randn(2, 2, 2)]
    ours, theirs = _params(*grads), _params(*grads)
    total = clip_grad_norm_(ours, max_norm, norm_type)
    expected = torch.nn.utils.clip_grad_norm_(theirs, max_norm, norm_type)
    torch.testing.assert_close(total, expected, rtol=1e-6, atol=0)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=0)
    if max_norm < float(expected):
        clipped = torch.cat([p.grad.flatten() for p in ours])
        assert abs(float(torch.linalg.vector_norm(clipped, norm_type)) - max_norm) < 1e-5


@pytest.mark.parametrize("norm_type", NORM_TYPES)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_gives_non_finite_total_and_leaves_grads_alone(norm_type, bad):
    g = torch.tensor([1.0, 2.0, bad, 4.0])
    params = _params(g, torch.tensor([3.0, 5.0]))
    total = clip_grad_norm_(params, 0.5, norm_type)
    assert not torch.isfinite(total)
    assert torch.equal(params[0].grad.isnan(), g.isnan())
    assert torch.equal(params[0].grad[~g.isnan()], g[~g.isnan()])  # inf stays inf, 1 stays 1
    assert torch.equal(params[1].grad, torch.tensor([3.0, 5.0]))
    with pytest.raises(RuntimeError, match="non-finite"):
        clip_grad_norm_(params, 0.5, norm_type, error_if_nonfinite=True)


def test_bad_arguments_and_no_grads():
    p = _params(torch.ones(3))
    with pytest.raises(ValueError, match="norm_type"):
        clip_grad_norm_(p, 1.0, norm_type=0)
    with pytest.raises(ValueError, match="max_norm"):
        clip_grad_norm_(p, -1.0)
    assert float(clip_grad_norm_([torch.nn.Parameter(torch.ones(2))], 1.0)) == 0.0


# Layouts a gradient can take on 4 ranks arranged as a (2, 2) mesh ("x", "y") or a 1-D mesh.
LAYOUTS = [
    ("plain", None),
    ("flat", (Shard(0),)),
    ("flat", (Replicate(),)),
    ("flat", (Shard(1),)),
    ("2d", (Shard(0), Shard(0))),
    ("2d", (Replicate(), Shard(0))),
    ("2d", (Shard(1), Replicate())),
    ("2d", (Shard(0), Shard(1))),
    ("2d", (Replicate(), Replicate())),
    ("2d", (_StridedShard(0, split_factor=2), Shard(0))),  # FSDP over experts sharded by ep
    ("y", (Shard(0),)),
    ("x", (Replicate(),)),
]


@st.composite
def split_case(draw):
    n = draw(st.integers(1, 6))
    params = []
    for _ in range(n):
        layout = draw(st.integers(0, len(LAYOUTS) - 1))
        strided = isinstance(LAYOUTS[layout][1] and LAYOUTS[layout][1][0], _StridedShard)
        rows = draw(st.sampled_from([4, 8]) if strided else st.integers(1, 9))
        cols = draw(st.integers(1, 5))
        scale = draw(st.sampled_from([1e-3, 1.0, 1e3]))
        params.append((layout, rows, cols, scale))
    return {
        "params": params,
        "norm_type": draw(st.sampled_from(NORM_TYPES)),
        "max_norm": draw(st.sampled_from([1e-2, 1.0, 1e9])),
        "seed": draw(st.integers(0, 2**16)),
    }


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _check_splits(max_examples):
    """Runs on every rank; derandomized hypothesis draws the same examples everywhere."""
    world = init_device_mesh("cpu", (2, 2), mesh_dim_names=("x", "y"))
    meshes = {"flat": world._flatten("flat"), "2d": world, "x": world["x"], "y": world["y"]}
    checked = []

    @settings(
        max_examples=max_examples,
        deadline=None,
        derandomize=True,
        database=None,
        phases=[Phase.generate],  # no shrinking: ranks must not wander off to different cases
        suppress_health_check=list(HealthCheck),
    )
    @given(case=split_case())
    def check(case):
        gen = torch.Generator().manual_seed(case["seed"])
        fulls, params = [], []
        for layout, rows, cols, scale in case["params"]:
            full = torch.randn(rows, cols, generator=gen) * scale
            kind, placements = LAYOUTS[layout]
            # clones: a replicated DTensor may alias its source, and clipping works in place
            grad = full.clone()
            if kind != "plain":
                grad = distribute_tensor(grad, meshes[kind], placements)
            p = torch.nn.Parameter(torch.zeros_like(grad))
            p.grad = grad
            fulls.append(full)
            params.append(p)
        before = [_local(p.grad).clone() for p in params]
        total = clip_grad_norm_(params, case["max_norm"], case["norm_type"])
        expected = torch.linalg.vector_norm(
            torch.cat([f.flatten() for f in fulls]).double(), case["norm_type"]
        )
        assert abs(float(total) - float(expected)) <= 1e-5 * float(expected)
        # every rank scales its own shard by the same coefficient
        coef = min(1.0, case["max_norm"] / (float(total) + 1e-6))
        for p, local in zip(params, before, strict=True):
            torch.testing.assert_close(_local(p.grad), local * coef, rtol=1e-5, atol=0)
        checked.append(float(total))

    check()
    return checked


def test_any_split_across_meshes_gives_the_single_process_norm():
    results = run_distributed(_check_splits, 4, 40, timeout=150)
    assert len(results[0]) >= 40
    assert all(r == results[0] for r in results)  # the same total on every rank


def _check_pipeline_stages():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    stage = mesh["pp"].get_local_rank()
    torch.manual_seed(0)
    stage_grads = [[torch.randn(6, 3), torch.randn(5)], [torch.randn(4, 4) * 3]]
    everything = torch.cat([g.flatten() for grads in stage_grads for g in grads])
    out = []
    for norm_type in (2.0, math.inf):
        params = []
        for i, full in enumerate(stage_grads[stage]):
            placement = Shard(0) if i % 2 == 0 else Replicate()
            p = torch.nn.Parameter(torch.zeros_like(full))
            p.grad = distribute_tensor(full.clone(), mesh["dp"], [placement])
            params.append(p)
        total = clip_grad_norm_(params, 1e9, norm_type, pp_mesh=mesh["pp"])
        out.append((float(total), float(torch.linalg.vector_norm(everything, norm_type))))
    return out


def test_pipeline_stages_combine_over_pp():
    for rank_results in run_distributed(_check_pipeline_stages, 4):
        for total, expected in rank_results:
            assert abs(total - expected) <= 1e-6 * expected


def _non_finite_on_one_rank():
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    out = []
    for norm_type in (2.0, math.inf):
        full = torch.arange(8.0)
        full[5] = float("nan")  # lives on rank 1 only
        p = torch.nn.Parameter(torch.zeros(8))
        p.grad = distribute_tensor(full, mesh, [Shard(0)])
        before = p.grad.to_local().clone()
        total = clip_grad_norm_([p], 1.0, norm_type)
        after = p.grad.to_local()
        out.append((float(total), torch.equal(after.nan_to_num(-1), before.nan_to_num(-1))))
    return out


def test_non_finite_shard_on_one_rank_makes_every_total_non_finite():
    for rank_results in run_distributed(_non_finite_on_one_rank, 2):
        for total, unchanged in rank_results:
            assert not math.isfinite(total)
            assert unchanged
