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

How FSDP divides depends on the reduce dtype and on the torch version (read in torch
2.13 ``_fsdp_collectives.py``: ``foreach_reduce`` and ``_get_gradient_divide_factors``):
  - a reduce-scatter runs (efsdp > 1): with ``set_force_sum_reduction_for_comms`` the
    collectives are plain sums (gloo has no ``PREMUL_SUM``) and FSDP divides by
    ``pre * post == factor``, in every reduce dtype;
  - no reduce-scatter (efsdp == 1): the single-rank branch divides by the factor, and on
    top of that an fp16 reduce (and a forced sum) splits the factor into a pre- and a
    post-division, so the factor is applied twice; older torch copies without dividing.
Rather than hard-code one version's arithmetic, :func:`expert_reduce_settings` measures
it: a one-element-per-rank probe unit on the experts' own mesh, with the experts' mixed
precision, runs one backward per candidate setting, and the first setting whose gradient
comes out as ``edp / dp`` (the rule above, for equal local gradients) is used. If none
does, it raises instead of training with a wrong scale.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from fsdp_ext.moe.layer import MoE
from fsdp_ext.parallel_dims import ParallelDims
from fsdp_ext.wrap import (
    GranularityPolicy,
    check_wrap,
    resolve_reshard_after_forward,
    shard_by_policy,
)


@dataclass(frozen=True)
class ExpertReduce:
    """What the expert units ask of FSDP so that their gradients come out divided by dp."""

    divide_factor: float
    force_sum_reduction: bool


def shard_moe_model(
    model: nn.Module,
    parallel_dims: ParallelDims,
    auto_wrap_policy: Any = None,
    **fully_shard_kwargs: Any,
) -> nn.Module:
    """Apply FSDP bottom-up: each MoE's experts, then the dense units, then the root.

    ``auto_wrap_policy`` picks the dense units, as in :func:`fsdp_ext.shard_by_policy`
    (default: ``GranularityPolicy()``, one unit per transformer block); the expert units
    exist already when it runs, so no dense unit counts or re-wraps them.
    ``fully_shard_kwargs`` (``mp_policy``, ``reshard_after_forward``, ...) go to every
    ``fully_shard`` call; ``mesh`` is ours.
    """
    if "mesh" in fully_shard_kwargs:
        raise TypeError("shard_moe_model picks the meshes from parallel_dims; do not pass mesh=")
    policy = GranularityPolicy() if auto_wrap_policy is None else auto_wrap_policy
    # a bad policy fails before anything is sharded, not after the experts are
    check_wrap(model, policy, mp_policy=fully_shard_kwargs.get("mp_policy"))
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    if moes:
        reduce = expert_reduce_settings(
            parallel_dims,
            fully_shard_kwargs.get("mp_policy", MixedPrecisionPolicy()),
            param_dtype=next(moes[0].experts.parameters()).dtype,
        )
        expert_kwargs = dict(fully_shard_kwargs)
        if "reshard_after_forward" in expert_kwargs:
            raf = resolve_reshard_after_forward(
                expert_kwargs["reshard_after_forward"], parallel_dims.edp_mesh
            )
            if parallel_dims.ep_enabled and not isinstance(raf, bool) and raf is not None:
                # FSDPParam.to_sharded_post_forward raises NotImplementedError (2.11-2.14)
                raise ValueError(
                    f"reshard_after_forward={fully_shard_kwargs['reshard_after_forward']!r} "
                    f"(an int, {raf}) cannot apply to expert-parallel experts (ep="
                    f"{parallel_dims.ep}): torch reshards DTensor parameters only to the whole "
                    "mesh; use ep=1 or a bool"
                )
            expert_kwargs["reshard_after_forward"] = raf
        for moe in moes:
            shard_experts(moe.experts, parallel_dims, reduce=reduce, **expert_kwargs)
    return shard_by_policy(
        model, auto_wrap_policy=policy, mesh=parallel_dims.dp_mesh, **fully_shard_kwargs
    )


def shard_experts(
    experts: nn.Module,
    parallel_dims: ParallelDims,
    *,
    reduce: ExpertReduce | None = None,
    **kwargs: Any,
) -> FSDPModule:
    """One FSDP unit per grouped-experts module, on the expert-data-parallel mesh.

    ``reduce`` defaults to :func:`expert_reduce_settings` for this mixed precision.
    """
    if reduce is None:
        reduce = expert_reduce_settings(
            parallel_dims,
            kwargs.get("mp_policy", MixedPrecisionPolicy()),
            param_dtype=next(experts.parameters()).dtype,
        )
    torch_fully_shard(experts, mesh=parallel_dims.edp_mesh, **kwargs)
    experts.set_gradient_divide_factor(reduce.divide_factor)
    experts.set_force_sum_reduction_for_comms(reduce.force_sum_reduction)
    return experts


def expert_reduce_settings(
    parallel_dims: ParallelDims,
    mp_policy: MixedPrecisionPolicy,
    *,
    param_dtype: torch.dtype = torch.float32,
) -> ExpertReduce:
    """The divide factor and sum forcing that make FSDP divide expert gradients by ``dp``.

    Collective over the expert-data-parallel mesh when it has more than one rank: every
    rank must call it, with the same arguments (``shard_moe_model`` does).
    """
    dp = float(parallel_dims.dp)
    if parallel_dims.efsdp > 1:
        candidates = [ExpertReduce(dp, True)]
    else:
        root = math.sqrt(dp)
        candidates = [
            ExpertReduce(dp, False),
            ExpertReduce(root, False),
            ExpertReduce(dp, True),
            ExpertReduce(root, True),
        ]
    edp = parallel_dims.dp // parallel_dims.ep
    measured = []
    for candidate in candidates:
        scale = _probe_gradient_scale(parallel_dims.edp_mesh, mp_policy, param_dtype, candidate)
        if math.isclose(scale, edp / dp, rel_tol=1e-2):
            return candidate
        measured.append((candidate, scale))
    raise RuntimeError(
        f"cannot make FSDP (torch {torch.__version__}) divide expert gradients by dp={dp:g} "
        f"with reduce dtype {mp_policy.reduce_dtype or mp_policy.param_dtype or param_dtype}: "
        f"wanted a gradient scale of {edp / dp:g}, measured {measured}"
    )


def _probe_gradient_scale(
    mesh: DeviceMesh,
    mp_policy: MixedPrecisionPolicy,
    param_dtype: torch.dtype,
    reduce: ExpertReduce,
) -> float:
    """One FSDP backward on the mesh with a local gradient of 1: what comes out per entry."""
    probe = nn.Linear(1, 2 * mesh.size(), bias=False, dtype=param_dtype)
    torch_fully_shard(probe, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=False)
    probe.set_gradient_divide_factor(reduce.divide_factor)
    probe.set_force_sum_reduction_for_comms(reduce.force_sum_reduction)
    weight = probe.weight.to_local()
    probe(torch.ones(1, 1, dtype=param_dtype, device=weight.device)).sum().backward()
    grad = probe.weight.grad.to_local().float()
    return float(grad.mean())
