"""How train.py lays the model over the ranks: experts over ep, FSDP by the --wrap policy,
1F1B under --pp, and the job's one ``CommConfig`` (--comm/--qwz/--hpz, or --comm auto's
decision) on every unit. As torchtitan's ``parallelize_llama``: the model knows nothing of it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy

import fsdp_ext
from examples.config import DTYPES, WRAP_POLICIES, TrainConfig, comm_settings
from examples.model import Transformer

__all__ = ["Parallel", "lm_loss", "parallelize", "shard_model"]


@dataclass
class Parallel:
    """What the training loop needs from the parallel layout, pipelined or not."""

    parts: list[nn.Module]  # this rank's model parts: the whole model, or its pp stages
    comm: (
        fsdp_ext.CommHandle | None
    )  # the job's fsdp_ext.CommConfig applied (None: all stock); checkpointed
    train_step: Callable[[torch.Tensor, torch.Tensor], float]  # forward + backward: global loss
    eval_step: Callable[[torch.Tensor, torch.Tensor], float]  # forward only: global loss
    pp_mesh: DeviceMesh | None = None  # for the gradient norm over the stages


def parallelize(model: Transformer, cfg: TrainConfig, dims: fsdp_ext.ParallelDims) -> Parallel:
    """Shard the model over the mesh (FSDP, experts over ep, pipelined under --pp > 1) and
    put the job's one ``CommConfig`` (--comm/--qwz/--hpz, or --comm auto's decision) on it."""
    comm = comm_settings(cfg, dims.world_size)
    if cfg.pp > 1:
        return pipelined(model, cfg, dims, comm)
    return sharded(model, cfg, dims, comm)


def _mp_policy(cfg: TrainConfig) -> MixedPrecisionPolicy:
    return MixedPrecisionPolicy(param_dtype=DTYPES[cfg.param_dtype], reduce_dtype=torch.float32)


def shard_model(
    model: Transformer,
    cfg: TrainConfig,
    dims: fsdp_ext.ParallelDims,
    comm: fsdp_ext.CommConfig | None = None,
) -> Transformer:
    """Experts over ep, one FSDP unit per expert group, the --wrap policy's units, the root;
    under ``comm.hpz`` each unit keeps its post-forward copy inside the node."""
    comm = comm_settings(cfg, dims.world_size) if comm is None else comm
    fsdp_ext.apply_expert_parallel(model, dims)
    kwargs = {"mp_policy": _mp_policy(cfg)}
    if comm.hpz:
        kwargs["reshard_after_forward"] = fsdp_ext.node_local_reshard(dims.dp_mesh, comm.node_size)
    return fsdp_ext.shard_moe_model(model, dims, auto_wrap_policy=WRAP_POLICIES[cfg.wrap], **kwargs)


def sharded(
    model: Transformer, cfg: TrainConfig, dims: fsdp_ext.ParallelDims, comm: fsdp_ext.CommConfig
) -> Parallel:
    """FSDP over the whole model (experts over --ep), ``comm`` on every unit."""
    shard_model(model, cfg, dims, comm)
    world = dist.get_world_size()

    def global_mean(loss: torch.Tensor) -> float:
        total = loss.detach().clone()
        dist.all_reduce(total)
        return float(total) / world

    def train_step(x: torch.Tensor, y: torch.Tensor) -> float:
        loss = lm_loss(model(x), y)
        loss.backward()
        return global_mean(loss)

    def eval_step(x: torch.Tensor, y: torch.Tensor) -> float:
        return global_mean(lm_loss(model(x), y))

    handle = fsdp_ext.enable(model, comm) if comm.enabled else None
    return Parallel([model], handle, train_step, eval_step)


def pipelined(
    model: Transformer, cfg: TrainConfig, dims: fsdp_ext.ParallelDims, comm: fsdp_ext.CommConfig
):
    """1F1B over --pp stages; inside each: experts over --ep, FSDP over dp, ``comm`` per unit."""
    schedule, stages = fsdp_ext.build_pipeline(
        model,
        dims,
        schedule="1F1B",
        n_microbatches=cfg.microbatches,
        loss_fn=lm_loss,
        auto_wrap_policy=WRAP_POLICIES[cfg.wrap],
        comm=comm,
        mp_policy=_mp_policy(cfg),
    )

    def step(x: torch.Tensor, y: torch.Tensor, forward_only: bool = False) -> float:
        losses = fsdp_ext.pipeline_step(schedule, stages, x, y, forward_only=forward_only)
        return fsdp_ext.reduce_pipeline_loss(losses, stages, dims)

    parts = [s.submod for s in stages]
    eval_step = lambda x, y: step(x, y, forward_only=True)  # noqa: E731
    return Parallel(parts, stages[0].comm_handle, step, eval_step, dims.pp_mesh)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
