"""Count what FSDP2 puts on the wire, from the tensors it hands to its collectives.

``unit.set_custom_reduce_scatter(CountingReduceScatter())`` (or ``set_custom_all_gather``)
runs the stock collective and records each call and the bytes a ring sends to other ranks
(:func:`fsdp_ext.testing.wire.sent_bytes`: ``(W - 1) / W`` of the reduce-scatter's input,
``W - 1`` times the all-gather's). Benchmarks and
tests read the counters instead of FSDP2's private state.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from fsdp_ext._torch import (
    AllGather,
    ReduceScatter,
    all_gather_into,
    reduce_scatter_into,
)
from fsdp_ext._torch import fsdp_units as all_fsdp_units
from fsdp_ext.testing.wire import sent_bytes

__all__ = ["CountingAllGather", "CountingReduceScatter", "fsdp_units"]


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class _Counting:
    """What both counting collectives share: the counters and FSDP's plain buffer."""

    def __init__(self) -> None:
        self.calls = 0
        self.wire_bytes = 0

    def reset(self) -> None:
        self.calls = self.wire_bytes = 0

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


class CountingReduceScatter(_Counting, ReduceScatter):
    """The stock reduce-scatter, counting ``calls`` and ``wire_bytes``."""

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        self.calls += 1
        self.wire_bytes += sent_bytes("reduce_scatter", _nbytes(input_tensor), group.size())
        return reduce_scatter_into(
            output_tensor, input_tensor, op=op, group=group, async_op=async_op
        )


class CountingAllGather(_Counting, AllGather):
    """The stock all-gather, counting ``calls`` and ``wire_bytes``."""

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        self.calls += 1
        self.wire_bytes += sent_bytes("all_gather", _nbytes(input_tensor), group.size())
        return all_gather_into(output_tensor, input_tensor, group=group, async_op=async_op)


def fsdp_units(model: nn.Module) -> list[tuple[str, FSDPModule]]:
    """(fqn, module) of every FSDP unit below and at ``model`` that manages parameters, in
    pre-order; a unit of several modules (``fully_shard([a, b])``) appears once, under its
    first module's name (the root's is ``""``)."""
    return [(unit.fqn, unit.module) for unit in all_fsdp_units(model) if unit.groups]
