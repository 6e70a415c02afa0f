"""Expert parallelism: experts split over the ``ep`` mesh, tokens moved by all-to-all.

Dispatch on each rank of an ep group (``E_local = num_experts / ep`` experts per rank):
  1. all-to-all of per-expert token counts, so each rank learns how many rows it will get
     from every peer for each of its experts (``received[r, e]``);
  2. autograd all-to-all of the expert-sorted rows (uneven splits, zero allowed; its
     backward is the transposed all-to-all). It is a small autograd Function over
     ``dist.all_to_all_single`` rather than funcol's ``all_to_all_single_autograd`` (which
     works on gloo too) so that the bytes of the backward exchanges can be counted;
  3. gather into expert-major order with ``fsdp_ext.kernels.permute_indices``;
  4. the grouped expert compute on local experts;
  5. the inverse gather, and the combine all-to-all back to the token owners.
Every step runs on every rank whatever the routing, so an expert with no tokens cannot
leave a peer waiting in a collective.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Shard, distribute_tensor

from fsdp_ext.kernels.permute_indices import permute_indices
from fsdp_ext.moe.layer import MoE
from fsdp_ext.parallel_dims import ParallelDims


@dataclass
class AllToAllStats:
    """What one rank's expert-parallel all-to-alls sent, forward and backward.

    ``bytes_sent``: the token rows (activations forward, their gradients backward)
    addressed to other ranks, counted from the split sizes of each exchange; rows a rank
    keeps for its own experts and the small per-expert count exchange are not included.
    ``exchanges``: row all-to-alls run (two per MoE layer forward, two backward).
    """

    bytes_sent: int = 0
    exchanges: int = 0

    def add(self, other: AllToAllStats) -> None:
        self.bytes_sent += other.bytes_sent
        self.exchanges += other.exchanges


def all_to_all_stats(model: nn.Module) -> AllToAllStats:
    """Totals over every expert-parallel MoE layer of ``model`` since
    :func:`apply_expert_parallel` (a copy: subtract two readings for an interval)."""
    total = AllToAllStats()
    for module in model.modules():
        dispatcher = getattr(module, "dispatcher", None)
        if isinstance(dispatcher, AllToAllDispatcher):
            total.add(dispatcher.stats)
    return total


class AllToAllDispatcher:
    """``GroupedExperts.dispatcher`` under expert parallelism over ``group``."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.ep = group.size()
        self.stats = AllToAllStats()

    def __call__(
        self,
        x: torch.Tensor,
        counts: torch.Tensor,
        compute: Callable[..., torch.Tensor],
        weights: tuple[torch.Tensor, ...],
    ) -> torch.Tensor:
        experts_per_rank = counts.numel() // self.ep
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.group)
        received = received.view(self.ep, experts_per_rank)
        send_splits = counts.view(self.ep, experts_per_rank).sum(dim=1).tolist()
        recv_splits = received.sum(dim=1).tolist()

        rows = _AllToAll.apply(x, recv_splits, send_splits, self)
        order = permute_indices(received)
        local_out = compute(rows[order], received.sum(dim=0), *weights)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        return _AllToAll.apply(local_out[inverse], send_splits, recv_splits, self)

    def all_to_all(self, x: torch.Tensor, out_splits: list[int], in_splits: list[int]):
        """Uneven all-to-all of rows (a split may be 0); counts the bytes sent to peers."""
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=self.group)
        row_bytes = x[0:1].numel() * x.element_size()
        me = self.group.rank()
        self.stats.bytes_sent += row_bytes * sum(s for r, s in enumerate(in_splits) if r != me)
        self.stats.exchanges += 1
        return out


class _AllToAll(torch.autograd.Function):
    """Rows out by ``in_splits``, in by ``out_splits``; backward is the transposed exchange."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, dispatcher):
        ctx.splits = (out_splits, in_splits)
        ctx.dispatcher = dispatcher
        return dispatcher.all_to_all(x, out_splits, in_splits)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        return ctx.dispatcher.all_to_all(grad, in_splits, out_splits), None, None, None


def apply_expert_parallel(model: nn.Module, parallel_dims: ParallelDims) -> nn.Module:
    """Make every :class:`MoE` in ``model`` data- and expert-parallel aware.

    - load-balancing statistics are counted over the whole data-parallel group (any ep);
    - with ``ep > 1``: expert weights become ``Shard(0)`` DTensors on the ep mesh (each
      rank keeps ``num_experts / ep`` experts) and tokens travel by all-to-all.
    Call after :meth:`ParallelDims.build_mesh` and before :func:`shard_moe_model`.
    """
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    dp_group = parallel_dims.dp_flat_mesh.get_group() if parallel_dims.dp > 1 else None
    for moe in moes:
        moe.load_balance_group = dp_group
        if not parallel_dims.ep_enabled:
            continue
        experts = moe.experts
        if experts.num_experts % parallel_dims.ep != 0:
            raise ValueError(f"ep={parallel_dims.ep} must divide num_experts={experts.num_experts}")
        ep_mesh = parallel_dims.ep_mesh
        for name, param in list(experts.named_parameters(recurse=False)):
            sharded = distribute_tensor(param.detach(), ep_mesh, [Shard(0)])
            experts.register_parameter(name, nn.Parameter(sharded, param.requires_grad))
        experts.dispatcher = AllToAllDispatcher(ep_mesh.get_group())
    return model
