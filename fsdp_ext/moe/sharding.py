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
from torch.distributed.fsdp import FSDPModule, fully_shard

from fsdp_ext.moe.layer import MoE
from fsdp_ext.moe.parallel_dims import ParallelDims


def shard_moe_model(
    model: nn.Module,
    parallel_dims: ParallelDims,
    auto_wrap_policy: Any = None,
    **fully_shard_kwargs: Any,
) -> nn.Module:
    """Apply FSDP bottom-up: each MoE's experts, then the dense units, then the root.

    ``auto_wrap_policy`` picks the dense units: ``None`` wraps every child of an
    ``nn.ModuleList`` (the transformer blocks); a set of module classes or a callable
    ``(module) -> bool`` selects modules. ``fully_shard_kwargs`` (``mp_policy``,
    ``reshard_after_forward``, ...) go to every ``fully_shard`` call; ``mesh`` is ours.
    """
    if "mesh" in fully_shard_kwargs:
        raise TypeError("shard_moe_model picks the meshes from parallel_dims; do not pass mesh=")
    _select_units(model, auto_wrap_policy)  # a bad policy fails before anything is sharded
    for moe in (m for m in model.modules() if isinstance(m, MoE)):
        shard_experts(moe.experts, parallel_dims, **fully_shard_kwargs)
    shard_dense(model, parallel_dims, auto_wrap_policy, **fully_shard_kwargs)
    return model


def shard_experts(experts: nn.Module, parallel_dims: ParallelDims, **kwargs: Any) -> FSDPModule:
    """One FSDP unit per grouped-experts module, on the expert-data-parallel mesh."""
    fully_shard(experts, mesh=parallel_dims.edp_mesh, **kwargs)
    experts.set_gradient_divide_factor(float(parallel_dims.dp))
    if parallel_dims.efsdp > 1:
        experts.set_force_sum_reduction_for_comms(True)
    return experts


def shard_dense(
    model: nn.Module, parallel_dims: ParallelDims, auto_wrap_policy: Any = None, **kwargs: Any
) -> nn.Module:
    """FSDP units on the dense dp mesh for the modules the policy selects, then the root."""
    mesh = parallel_dims.dp_mesh
    units = [m for m in _select_units(model, auto_wrap_policy) if not isinstance(m, FSDPModule)]
    for module in reversed(units):  # children before parents
        fully_shard(module, mesh=mesh, **kwargs)
    fully_shard(model, mesh=mesh, **kwargs)
    return model


def _select_units(model: nn.Module, policy: Any) -> list[nn.Module]:
    """Modules that become dense FSDP units, in ``model.modules()`` order (parents first)."""
    if policy is None:
        return [
            block
            for module in model.modules()
            if isinstance(module, nn.ModuleList)
            for block in module
        ]
    if isinstance(policy, (set, frozenset, tuple, list)) and all(
        isinstance(c, type) and issubclass(c, nn.Module) for c in policy
    ):
        classes = tuple(policy)
        return [m for m in model.modules() if m is not model and isinstance(m, classes)]
    if callable(policy):
        return [m for m in model.modules() if m is not model and policy(m)]
    raise TypeError(
        "auto_wrap_policy must be None, a set of nn.Module classes or a callable "
        f"(module) -> bool, got {policy!r}"
    )
