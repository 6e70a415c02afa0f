"""``build_pipeline``: this rank's stages, FSDP on each, comm on each unit, and a schedule.

The order, torchtitan's: split (keeping fqns) -> expert parallel -> FSDP over the dp
meshes -> comm hooks -> ``PipelineStage`` on the pp mesh -> schedule.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import schedules as torch_schedules

from fsdp_ext._torch import ReduceScatter, fsdp_units, post_forward_meshes_built_together
from fsdp_ext.comm import CommConfig, enable
from fsdp_ext.moe import MoE, apply_expert_parallel, shard_moe_model
from fsdp_ext.parallel_dims import ParallelDims
from fsdp_ext.pipeline.split import Cost, build_stage, find_blocks, plan_stages
from fsdp_ext.pipeline.stage import GRAD_SYNC_MODES, FSDPPipelineStage
from fsdp_ext.wrap import GranularityPolicy, node_local_reshard, shard_by_policy

# name -> (schedule class, stage placement). "loop": stage s on pp rank s % pp;
# "v": rank r holds stages r and 2 * pp - 1 - r; "single": one stage per rank.
SCHEDULES: dict[str, tuple[type, str]] = {
    "GPipe": (torch_schedules.ScheduleGPipe, "single"),
    "1F1B": (torch_schedules.Schedule1F1B, "single"),
    "Interleaved1F1B": (torch_schedules.ScheduleInterleaved1F1B, "loop"),
    "LoopedBFS": (torch_schedules.ScheduleLoopedBFS, "loop"),
    "InterleavedZeroBubble": (torch_schedules.ScheduleInterleavedZeroBubble, "loop"),
    "ZBVZeroBubble": (torch_schedules.ScheduleZBVZeroBubble, "v"),
}
SPLIT_BACKWARD_SCHEDULES = ("InterleavedZeroBubble", "ZBVZeroBubble")


def stage_indices(schedule: str, pp_rank: int, pp: int, stages_per_rank: int) -> list[int]:
    """The global stage indices that pp rank ``pp_rank`` holds, in order."""
    placement = SCHEDULES[schedule][1]
    if placement == "single":
        return [pp_rank]
    if placement == "v":
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(stages_per_rank)]


def _check_args(
    parallel_dims, schedule, n_microbatches, loss_fn, grad_sync, reshard_after_forward, comm, kw
):
    if not isinstance(parallel_dims, ParallelDims):
        raise TypeError(f"parallel_dims must be a ParallelDims, got {type(parallel_dims).__name__}")
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {sorted(SCHEDULES)}, got {schedule!r}")
    if (
        isinstance(n_microbatches, bool)
        or not isinstance(n_microbatches, int)
        or n_microbatches < 1
    ):
        raise ValueError(f"n_microbatches must be an int >= 1, got {n_microbatches!r}")
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be a callable (output, target) -> loss, got {loss_fn!r}")
    if grad_sync not in GRAD_SYNC_MODES:
        raise ValueError(f"grad_sync must be one of {GRAD_SYNC_MODES}, got {grad_sync!r}")
    if reshard_after_forward is not None and not isinstance(reshard_after_forward, (bool, int)):
        raise ValueError(
            f"reshard_after_forward must be None, a bool or an int, got {reshard_after_forward!r}"
        )
    if comm is not None and not isinstance(comm, (CommConfig, ReduceScatter)):
        raise TypeError(
            f"comm must be None, a CommConfig or an FSDP ReduceScatter, got {type(comm).__name__}"
        )
    gradients = isinstance(comm, CommConfig) and comm.gradients is not None
    if gradients and parallel_dims.dp_replicate > 1:
        raise ValueError(
            "comm=CommConfig(gradients=...) under PP supports dp_replicate=1 only (no HSDP)"
        )
    hpz = isinstance(comm, CommConfig) and comm.hpz
    if hpz and reshard_after_forward is not None:
        raise ValueError(
            "comm=CommConfig(hpz=True) sets reshard_after_forward to the ranks "
            f"per node; leave reshard_after_forward None, got {reshard_after_forward!r}"
        )
    if hpz and parallel_dims.ep_enabled:
        raise ValueError(
            "comm=CommConfig(hpz=True) with ep > 1: torch cannot reshard "
            "expert-parallel experts to a node; use ep=1 or drop hpz"
        )
    if schedule in SPLIT_BACKWARD_SCHEDULES and (
        grad_sync != "deferred" or reshard_after_forward or hpz
    ):
        # Their weight-gradient pass runs after FSDP's post-backward hook has fired, so a
        # per-microbatch reduction or a resharded parameter misses it (measured: wrong or
        # missing gradients on gloo).
        raise ValueError(
            f"schedule {schedule!r} splits backward into input and weight passes; it needs "
            "grad_sync='deferred' and reshard_after_forward False/None, got "
            f"grad_sync={grad_sync!r}, reshard_after_forward={reshard_after_forward!r}"
        )
    if "mesh" in kw:
        raise TypeError("build_pipeline picks the meshes from parallel_dims; do not pass mesh=")


def build_pipeline(
    model: nn.Module,
    parallel_dims: ParallelDims,
    *,
    schedule: str = "1F1B",
    n_microbatches: int,
    loss_fn: Callable[..., torch.Tensor],
    auto_wrap_policy: Any = None,
    grad_sync: str = "deferred",
    reshard_after_forward: bool | int | None = None,
    comm: CommConfig | ReduceScatter | None = None,
    stages_per_rank: int | None = None,
    cost: str | Cost = "params",
    **fully_shard_kwargs: Any,
) -> tuple[Any, list[FSDPPipelineStage]]:
    """Pipeline ``model`` over ``parallel_dims.pp_mesh`` with FSDP inside every stage.

    - ``model``'s blocks are split with :func:`split_stages` (``cost``); the stages share
      modules with ``model``, which should not be used afterwards.
    - Each local stage gets expert parallelism if it holds :class:`MoE` layers, then
      ``fsdp_ext.shard_by_policy`` over the dp mesh (``shard_moe_model`` when ``ep > 1``)
      with ``auto_wrap_policy`` (default ``GranularityPolicy()``: one unit per block).
    - ``comm``: a ``CommConfig`` (``fsdp_ext.comm.enable`` per stage, ZeRO++'s qgZ/LoCo,
      qwZ and hpZ; the handle is ``stage.comm_handle``; hpZ sets ``reshard_after_forward``
      to the dp ranks per node; ``CommConfig(gradients="loco")`` for gradients alone), or
      an FSDP ``ReduceScatter`` set on every unit.
    - ``grad_sync``: ``"deferred"`` (one reduce-scatter per unit per step; unsharded
      gradients held across microbatches) or ``"per_microbatch"`` (gradients sharded).
    - ``reshard_after_forward`` defaults to False under PP (one all-gather per step).
    - ``stages_per_rank``: for multi-stage schedules (default 2).
    Returns ``(schedule, stages)``; call ``schedule.step(x, target=y, losses=losses)``.
    """
    _check_args(
        parallel_dims,
        schedule,
        n_microbatches,
        loss_fn,
        grad_sync,
        reshard_after_forward,
        comm,
        fully_shard_kwargs,
    )
    schedule_cls, placement = SCHEDULES[schedule]
    if placement == "single":
        if stages_per_rank not in (None, 1):
            raise ValueError(
                f"schedule {schedule!r} runs one stage per rank, not {stages_per_rank}"
            )
        stages_per_rank = 1
    elif placement == "v":
        if stages_per_rank not in (None, 2):
            raise ValueError(
                f"schedule {schedule!r} runs two stages per rank, not {stages_per_rank}"
            )
        stages_per_rank = 2
    else:
        stages_per_rank = 2 if stages_per_rank is None else stages_per_rank
        if isinstance(stages_per_rank, bool) or not isinstance(stages_per_rank, int):
            raise ValueError(f"stages_per_rank must be an int >= 1, got {stages_per_rank!r}")
        if stages_per_rank < 1:
            raise ValueError(f"stages_per_rank must be an int >= 1, got {stages_per_rank!r}")
    pp = parallel_dims.pp
    _check_stage_count(model, schedule, pp, stages_per_rank, n_microbatches)
    pp_mesh = parallel_dims.pp_mesh
    pp_rank = pp_mesh.get_local_rank()
    num_stages = pp * stages_per_rank
    plan = plan_stages(model, num_stages, cost=cost)
    if dist.get_rank() == 0:
        print(plan)
    reshard = False if reshard_after_forward is None else reshard_after_forward
    if isinstance(comm, CommConfig) and comm.hpz:
        reshard = node_local_reshard(parallel_dims.dp_mesh, comm.node_size)
    device = torch.device(parallel_dims.world_mesh.device_type)
    indices = list(stage_indices(schedule, pp_rank, pp, stages_per_rank))
    stages = []
    # An int reshard: every rank builds every stage's post-forward mesh in one call first
    # (FSDP would build one per unit, a world-wide rendezvous each, and stages differ in
    # units: the job would hang).
    shared_meshes = (
        contextlib.nullcontext()
        if isinstance(reshard, bool)
        else post_forward_meshes_built_together(parallel_dims.dp_mesh, reshard)
    )
    with shared_meshes:
        modules = [build_stage(model, plan, index) for index in indices]
        for module in modules:
            _shard_stage(module, parallel_dims, auto_wrap_policy, reshard, fully_shard_kwargs)
    for index, module in zip(indices, modules, strict=True):
        stage = FSDPPipelineStage(
            module,
            index,
            num_stages,
            device,
            group=pp_mesh.get_group(),
            grad_sync=grad_sync,
            reshard_after_backward=bool(reshard),
            n_microbatches=n_microbatches,
        )
        stage.comm_handle = _register_comm(module, comm)
        stages.append(stage)
    kwargs = dict(n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=True)
    runner = (
        schedule_cls(stages[0], **kwargs)
        if placement == "single"
        else schedule_cls(stages, **kwargs)
    )
    return runner, stages


def _check_stage_count(
    model: nn.Module, schedule: str, pp: int, stages_per_rank: int, n_microbatches: int
) -> None:
    """Errors in the arguments the caller passed (pp, stages_per_rank), not num_stages."""
    stages = f"pp={pp}" if stages_per_rank == 1 else f"pp={pp} x stages_per_rank={stages_per_rank}"
    fqn, container = find_blocks(model)
    blocks = list(container.named_children())
    if pp * stages_per_rank > len(blocks):
        fewer = "pp" if stages_per_rank == 1 else "pp or stages_per_rank"
        raise ValueError(
            f"{stages} = {pp * stages_per_rank} stages exceed the {len(blocks)} blocks of "
            f"{fqn or type(model).__name__} (every stage needs one block at least); "
            f"lower {fewer}"
        )
    if schedule == "1F1B" and n_microbatches < pp:
        raise ValueError(
            f"schedule '1F1B' keeps one microbatch in flight per stage: it needs "
            f"n_microbatches >= pp, got n_microbatches={n_microbatches} with pp={pp}"
        )


def _shard_stage(module, parallel_dims, auto_wrap_policy, reshard, kwargs) -> None:
    policy = GranularityPolicy() if auto_wrap_policy is None else auto_wrap_policy
    has_moe = any(isinstance(m, MoE) for m in module.modules())
    if has_moe:
        apply_expert_parallel(module, parallel_dims)
    if has_moe and parallel_dims.ep_enabled:
        shard_moe_model(module, parallel_dims, policy, reshard_after_forward=reshard, **kwargs)
    else:
        shard_by_policy(
            module,
            auto_wrap_policy=policy,
            mesh=parallel_dims.dp_mesh,
            reshard_after_forward=reshard,
            **kwargs,
        )


def _register_comm(module: nn.Module, comm):
    if comm is None:
        return None
    if isinstance(comm, CommConfig):
        return enable(module, comm) if comm.enabled else None
    for unit in fsdp_units(module):
        unit.modules[0].set_custom_reduce_scatter(comm)
    return None
