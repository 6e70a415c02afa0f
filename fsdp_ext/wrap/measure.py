"""Measure what FSDP2 really holds unsharded: live parameter and gradient bytes.

CPU tensors have no allocator statistics, and on GPUs the caching allocator mixes in
activations, so the planner's estimate is checked against FSDP2's own state instead.
Hooks on ``FSDPParamGroup`` sample, just before every point where FSDP2 frees something
(``_to_sharded``, ``_to_sharded_post_forward``, ``post_backward``) and after every
all-gather, the sum over all param groups of

* unsharded parameters: groups that are unsharded or have an all-gather in flight;
* post-forward shards: groups resharded to a smaller world (int ``reshard_after_forward``);
* unsharded gradients: ``unsharded_param.grad`` and accumulated gradients.

Bytes only grow between those points (all-gathers and autograd writing gradients), so
the largest sample is the peak. Reusable: any code that runs FSDP2 units (the pipeline
schedules too) can be measured inside ``with UnshardedBytesTracker() as tracker``.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from fsdp_ext._torch import (
    GROUP_TRANSITIONS_AFTER,
    GROUP_TRANSITIONS_BEFORE,
    FSDPParamGroup,
    gathered_bytes,
    has_all_gather_in_flight,
    sharded_post_forward_data,
    unsharded_param,
)


def _nbytes(tensor: torch.Tensor | None) -> int:
    if tensor is None:
        return 0
    if isinstance(tensor, DTensor):
        tensor = tensor.to_local()
    return tensor.numel() * tensor.element_size()


def _group_param_bytes(group: FSDPParamGroup) -> int:
    return sum(gathered_bytes(p) for p in group.fsdp_params)


def live_unsharded_bytes(groups: list[FSDPParamGroup]) -> int:
    """Unsharded parameter, post-forward shard and unsharded gradient bytes held now."""
    total = 0
    for group in groups:
        if group.is_unsharded or has_all_gather_in_flight(group):
            total += _group_param_bytes(group)
        elif group.is_sharded_post_forward:
            total += sum(_nbytes(sharded_post_forward_data(p)) for p in group.fsdp_params)
        for param in group.fsdp_params:
            unsharded = unsharded_param(param)
            if unsharded is not None:
                total += _nbytes(unsharded.grad)
            total += _nbytes(param.unsharded_accumulated_grad)
    return total


class UnshardedBytesTracker:
    """Peak of :func:`live_unsharded_bytes` over every FSDP2 param group in the process.

    ``peak_bytes`` is the largest sample since entering (or since :meth:`reset`).
    """

    def __init__(self) -> None:
        self.peak_bytes = 0
        self.samples = 0
        self._groups: dict[int, FSDPParamGroup] = {}
        self._originals: dict[str, Any] = {}

    def reset(self) -> None:
        self.peak_bytes = 0
        self.samples = 0

    def _sample(self, group: FSDPParamGroup) -> None:
        self._groups.setdefault(id(group), group)
        self.samples += 1
        self.peak_bytes = max(self.peak_bytes, live_unsharded_bytes(list(self._groups.values())))

    def __enter__(self) -> UnshardedBytesTracker:
        tracker = self
        for name in (*GROUP_TRANSITIONS_BEFORE, *GROUP_TRANSITIONS_AFTER):
            original = getattr(FSDPParamGroup, name)
            self._originals[name] = original

            def wrapped(
                group, *args, _original=original, _after=name in GROUP_TRANSITIONS_AFTER, **kw
            ):
                if not _after:
                    tracker._sample(group)
                out = _original(group, *args, **kw)
                if _after:
                    tracker._sample(group)
                return out

            setattr(FSDPParamGroup, name, functools.wraps(original)(wrapped))
        return self

    def __exit__(self, *exc: object) -> None:
        for name, original in self._originals.items():
            setattr(FSDPParamGroup, name, original)
        self._originals.clear()
