"""Shared pieces of the pipeline tests: the model, the data, the single-process reference,
and a rank-side runner that trains a pipelined model and counts its collectives."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
    DefaultAllGather,
    DefaultReduceScatter,
)
from torch.distributed.tensor import DTensor

import fsdp_ext
from examples.model import ModelConfig, Transformer

VOCAB, SEQ, GLOBAL_BATCH, STEPS, LR = 64, 8, 8, 5, 0.5


class CountingReduceScatter(DefaultReduceScatter):
    """The stock reduce-scatter, counting calls and the bytes a ring sends."""

    def __init__(self):
        self.calls = 0
        self.wire_bytes = 0

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        self.calls += 1
        w = group.size()
        self.wire_bytes += input_tensor.numel() * input_tensor.element_size() * (w - 1) // w
        return super().__call__(output_tensor, input_tensor, group, op, async_op)


class CountingAllGather(DefaultAllGather):
    def __init__(self):
        self.calls = 0
        self.wire_bytes = 0

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        self.calls += 1
        w = group.size()
        self.wire_bytes += output_tensor.numel() * output_tensor.element_size() * (w - 1) // w
        return super().__call__(output_tensor, input_tensor, group, async_op)


def model_config(moe: bool = False, n_layers: int = 4) -> ModelConfig:
    return ModelConfig(
        vocab_size=VOCAB,
        dim=32,
        n_layers=n_layers,
        n_heads=2,
        hidden_dim=64,
        max_seq_len=SEQ,
        num_experts=4 if moe else 0,
        top_k=2,
        moe_hidden_dim=16,
        load_balance_coef=0.01 if moe else 0.0,
    )


def make_model(moe: bool = False, n_layers: int = 4, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(model_config(moe, n_layers))


def batches(steps: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (
            torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g),
            torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g),
        )
        for _ in range(steps)
    ]


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


@functools.lru_cache(maxsize=8)
def reference(moe: bool, dp: int, n_microbatches: int, steps: int = STEPS, n_layers: int = 4):
    """One process, the same global batch: microbatch m is the concatenation over the dp
    ranks of each rank's m-th local microbatch; grads are summed over microbatches and
    divided by their number (the schedule's ``scale_grads``), then SGD."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: intra-op threads only contend (50x slower seen)
    try:
        return _reference(moe, dp, n_microbatches, steps, n_layers)
    finally:
        torch.set_num_threads(threads)


def _reference(moe: bool, dp: int, n_microbatches: int, steps: int, n_layers: int):
    model = make_model(moe, n_layers)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, grads = [], []
    for x, y in batches(steps):
        local = GLOBAL_BATCH // dp
        mb = local // n_microbatches
        step_losses = []
        for m in range(n_microbatches):
            rows = torch.cat(
                [torch.arange(d * local + m * mb, d * local + (m + 1) * mb) for d in range(dp)]
            )
            loss = loss_fn(model(x[rows]), y[rows])
            loss.backward()
            step_losses.append(loss.item())
        for p in model.parameters():
            p.grad /= n_microbatches
        losses.append(sum(step_losses) / n_microbatches)
        grads.append({k: p.grad.clone() for k, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    return losses, grads


def run_pipeline(
    *,
    schedule: str = "1F1B",
    grad_sync: str = "deferred",
    reshard_after_forward=None,
    n_microbatches: int = 4,
    moe: bool = False,
    ep: int = 1,
    pp: int = 2,
    loco: bool = False,
    steps: int = STEPS,
    n_layers: int = 4,
) -> dict:
    """On every rank: train ``steps`` steps; return losses, full grads and counts."""
    import torch.distributed as dist

    world = dist.get_world_size()
    dims = fsdp_ext.ParallelDims(world, pp=pp, ep=ep)
    dims.build_mesh("cpu")
    rs = CountingReduceScatter()
    comm = fsdp_ext.CommConfig(gradients=fsdp_ext.LoCoConfig(group_size=32)) if loco else rs
    schedule_obj, stages = fsdp_ext.build_pipeline(
        make_model(moe, n_layers),
        dims,
        schedule=schedule,
        n_microbatches=n_microbatches,
        loss_fn=loss_fn,
        grad_sync=grad_sync,
        reshard_after_forward=reshard_after_forward,
        comm=comm,
    )
    ag = CountingAllGather()
    units = 0
    for stage in stages:
        for module in stage.submod.modules():
            if isinstance(module, FSDPModule):
                module.set_custom_all_gather(ag)
                units += module._get_fsdp_state()._fsdp_param_group is not None
    params = [p for s in stages for p in s.submod.parameters()]
    opt = torch.optim.SGD(params, lr=LR)
    dp_rank, dp = dims.dp_flat_mesh.get_local_rank(), dims.dp
    local = GLOBAL_BATCH // dp
    out = {"losses": [], "grads": [], "rs": [], "ag": [], "units": units, "loco_bytes": []}
    for x, y in batches(steps):
        rs.calls = ag.calls = 0
        handles = [s.comm_handle for s in stages if s.comm_handle is not None]
        for h in handles:
            h.reset_stats()
        rows = slice(dp_rank * local, (dp_rank + 1) * local)
        losses = fsdp_ext.pipeline_step(schedule_obj, stages, x[rows], y[rows])
        out["losses"].append(fsdp_ext.reduce_pipeline_loss(losses, stages, dims))
        grads = {}
        for stage in stages:
            for name, p in stage.submod.named_parameters():
                grads[name] = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        out["grads"].append(grads)
        out["rs"].append(sum(h.stats.reductions for h in handles) if loco else rs.calls)
        out["ag"].append(ag.calls)
        out["loco_bytes"].append(sum(h.stats.bytes_sent for h in handles))
        opt.step()
        opt.zero_grad()
    # a forward-only step (validation) reduces nothing
    rs.calls = 0
    stats = [s.comm_handle.stats.reductions for s in stages if s.comm_handle is not None]
    fsdp_ext.pipeline_step(schedule_obj, stages, x[rows], y[rows], forward_only=True)
    after = [s.comm_handle.stats.reductions for s in stages if s.comm_handle is not None]
    out["eval_rs"] = rs.calls + sum(after) - sum(stats)
    return out


def run_many(cases: list[dict]) -> list[dict]:
    return [run_pipeline(**case) for case in cases]
