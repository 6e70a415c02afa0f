"""FSDP for a MoE model: experts on the expert-data-parallel mesh, the rest on dp.

The scaling rule. The loss is the mean over the global batch, i.e. the mean over the
``dp`` data-parallel ranks of each rank's local mean, so every parameter's gradient
must be ``(1/dp) * sum over all dp ranks of the local gradients``.
  - A dense parameter gets its local gradient on every dp rank: FSDP's average over the
    dp mesh is exactly that.
  - An expert's local gradient on an ep rank already sums the contributions of all
    ``ep`` ranks of its group (their tokens came to it by all-to-all, and went back in
    backward). Summing over the ``edp = dp / ep`` replicas of that expert then covers
    every dp rank once, so the divisor must be ``dp``. FSDP's default average over the
    edp mesh divides by ``dp / ep``: the classic "expert gradients ``ep`` times too big".
So every expert unit gets ``set_gradient_divide_factor(dp)``.

Gloo has no ``PREMUL_SUM``, which is what a custom factor turns the reduce-scatter into;
with an efsdp group larger than 1 we ask FSDP for plain sums plus a separate division
(``set_force_sum_reduction_for_comms``). With efsdp == 1 FSDP skips the reduce-scatter
and divides once itself; forcing sums there would divide twice (torch 2.11-2.13), so the
force is only set where a reduce-scatter runs.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from fsdp_ext.moe.layer import MoE
from fsdp_ext.moe.parallel_dims import ParallelDims
from fsdp_ext.wrap import GranularityPolicy, fully_shard, plan_units


def shard_moe_model(
    model: nn.Module,
    parallel_dims: ParallelDims,
    auto_wrap_policy: Any = None,
    **fully_shard_kwargs: Any,
) -> nn.Module:
    """Apply FSDP bottom-up: each MoE's experts, then the dense units, then the root.

    ``auto_wrap_policy`` picks the dense units, as in :func:`fsdp_ext.fully_shard`
    (default: ``GranularityPolicy()``, one unit per transformer block); the expert units
    exist already when it runs, so no dense unit counts or re-wraps them.
    ``fully_shard_kwargs`` (``mp_policy``, ``reshard_after_forward``, ...) go to every
    ``fully_shard`` call; ``mesh`` is ours.
    """
    if "mesh" in fully_shard_kwargs:
        raise TypeError("shard_moe_model picks the meshes from parallel_dims; do not pass mesh=")
    policy = GranularityPolicy() if auto_wrap_policy is None else auto_wrap_policy
    plan_units(model, policy)  # a bad policy fails before anything is sharded
    for moe in (m for m in model.modules() if isinstance(m, MoE)):
        shard_experts(moe.experts, parallel_dims, **fully_shard_kwargs)
    return fully_shard(
        model, auto_wrap_policy=policy, mesh=parallel_dims.dp_mesh, **fully_shard_kwargs
    )


def shard_experts(experts: nn.Module, parallel_dims: ParallelDims, **kwargs: Any) -> FSDPModule:
    """One FSDP unit per grouped-experts module, on the expert-data-parallel mesh."""
    torch_fully_shard(experts, mesh=parallel_dims.edp_mesh, **kwargs)
    experts.set_gradient_divide_factor(float(parallel_dims.dp))
    if parallel_dims.efsdp > 1:
        experts.set_force_sum_reduction_for_comms(True)
    return experts
