"""Expert gradients have the right scale in every reduce dtype, layout and torch version.

FSDP divides gradients in different places depending on the reduce dtype (fp16 splits the
factor into a pre- and a post-division; fp32/bf16 divide once, inside the collective or
after it) and on whether a reduce-scatter runs at all (an efsdp group of one rank takes a
separate branch). Each layout below trains one step under every reduce dtype; its expert
and dense gradients are compared with the fp32 single-process gradient on the global batch.
"""

import dataclasses
import functools

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy

from benchmarks.moe import Case, build_model, global_batch, lm_loss
from fsdp_ext import ParallelDims, apply_expert_parallel, shard_moe_model
from fsdp_ext.moe.sharding import expert_reduce_settings
from fsdp_ext.testing import run_distributed

CASE = dataclasses.replace(Case(), num_layers=1)
REDUCE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# (ep, dp_replicate) per world size; efsdp = world / (dp_replicate * ep)
LAYOUTS = {2: [(2, 1)], 4: [(4, 1), (2, 2), (2, 1)]}
# Relative error of a gradient's norm. fp32 is reassociation only. An fp16/bf16 reduce
# rounds every entry (2^-11 / 2^-8 relative), which mostly averages out in a norm:
# measured worst expert 3e-5 (fp16) / 6e-5 (bf16); dense bf16 1.3e-3 on a 32-entry
# LayerNorm weight. A wrong divisor is off by a factor of 2 or more.
EXPERT_NORM_RTOL = {"fp32": 1e-5, "bf16": 1e-3, "fp16": 1e-3}
DENSE_NORM_RTOL = {"fp32": 1e-5, "bf16": 5e-3, "fp16": 1e-3}


def _one_step(dims: ParallelDims, reduce_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    model = build_model(CASE)
    apply_expert_parallel(model, dims)
    shard_moe_model(model, dims, mp_policy=MixedPrecisionPolicy(reduce_dtype=reduce_dtype))
    per_rank = CASE.global_batch // dims.dp
    dp_rank = dims.dp_flat_mesh.get_local_rank()
    inputs, targets = global_batch(CASE, 0)
    rows = slice(dp_rank * per_rank, (dp_rank + 1) * per_rank)
    lm_loss(model, inputs[rows], targets[rows]).backward()
    return {n: p.grad.full_tensor() for n, p in model.named_parameters()}


def _rank_grads(layouts):
    out = {}
    for ep, dp_replicate in layouts:
        dims = ParallelDims(dist.get_world_size(), dp_replicate=dp_replicate, ep=ep)
        dims.build_mesh("cpu")
        for name, dtype in REDUCE_DTYPES.items():
            mp_policy = MixedPrecisionPolicy(reduce_dtype=dtype)
            settings = expert_reduce_settings(dims, mp_policy)
            out[(ep, dp_replicate, name)] = (settings, _one_step(dims, dtype))
    return out


@functools.cache
def _runs(world):
    return run_distributed(_rank_grads, world, LAYOUTS[world], timeout=240)


@functools.cache
def _reference():
    model = build_model(CASE)
    lm_loss(model, *global_batch(CASE, 0)).backward()
    return {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("world", sorted(LAYOUTS))
def test_gradient_norms_match_fp32_reference_in_every_reduce_dtype(world):
    reference = _reference()
    for rank, grads in enumerate(_runs(world)):
        for (ep, dp_replicate, dtype), (_, got) in grads.items():
            for name, expected in reference.items():
                ratio = float(got[name].norm() / expected.norm())
                where = f"rank {rank} ep={ep} dp_replicate={dp_replicate} {dtype} {name}"
                rtol = (EXPERT_NORM_RTOL if ".experts." in name else DENSE_NORM_RTOL)[dtype]
                assert abs(ratio - 1.0) <= rtol, f"{where}: norm ratio {ratio}"
                if dtype == "fp32":
                    atol = 1e-6 * float(expected.abs().max())
                    torch.testing.assert_close(got[name], expected, rtol=1e-5, atol=atol)


def _expected_settings_torch_2_13(world, ep, dp_replicate, dtype):
    """Read in torch 2.13 ``foreach_reduce``: without a reduce-scatter (efsdp == 1) the
    single-rank branch divides by the factor, and fp16 also divides by pre * post ==
    factor, so fp16 needs sqrt(dp); with a reduce-scatter, forced sums divide once."""
    dp = world
    if world // (dp_replicate * ep) > 1:
        return (dp, True)
    return (dp**0.5 if dtype == "fp16" else dp, False)


@pytest.mark.skipif(not torch.__version__.startswith("2.13"), reason="pins 2.13's arithmetic")
@pytest.mark.parametrize("world", sorted(LAYOUTS))
def test_probe_picks_the_settings_read_in_torch_source(world):
    for (ep, dp_replicate, dtype), (settings, _) in _runs(world)[0].items():
        want = _expected_settings_torch_2_13(world, ep, dp_replicate, dtype)
        got = (settings.divide_factor, settings.force_sum_reduction)
        assert got[1] == want[1] and abs(got[0] - want[0]) < 1e-12, (ep, dp_replicate, dtype)
