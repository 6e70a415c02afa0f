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
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from fsdp_ext._torch import (
    GROUP_TRANSITIONS_AFTER,
    GROUP_TRANSITIONS_BEFORE,
    FSDPParamGroup,
    fsdp_params,
    fsdp_units,
    gathered_bytes,
    has_all_gather_in_flight,
    is_sharded_post_forward,
    is_unsharded,
    sharded_post_forward_data,
    unsharded_accumulated_grad,
    unsharded_param,
)


def _nbytes(tensor: torch.Tensor | None) -> int:
    if tensor is None:
        return 0
    if isinstance(tensor, DTensor):
        tensor = tensor.to_local()
    return tensor.numel() * tensor.element_size()


def _group_param_bytes(group: FSDPParamGroup) -> int:
    return sum(gathered_bytes(p) for p in fsdp_params(group))


def live_unsharded_split(groups: list[FSDPParamGroup]) -> tuple[int, int]:
    """(parameter bytes, gradient bytes) held unsharded now: gathered parameters and
    post-forward shards, then unsharded and accumulated gradients."""
    params = grads = 0
    for group in groups:
        if is_unsharded(group) or has_all_gather_in_flight(group):
            params += _group_param_bytes(group)
        elif is_sharded_post_forward(group):
            params += sum(_nbytes(sharded_post_forward_data(p)) for p in fsdp_params(group))
        for param in fsdp_params(group):
            unsharded = unsharded_param(param)
            if unsharded is not None:
                grads += _nbytes(unsharded.grad)
            grads += _nbytes(unsharded_accumulated_grad(param))
    return params, grads


def live_unsharded_bytes(groups: list[FSDPParamGroup]) -> int:
    """Unsharded parameter, post-forward shard and unsharded gradient bytes held now."""
    return sum(live_unsharded_split(groups))


class UnshardedBytesTracker:
    """Peak of :func:`live_unsharded_bytes` over FSDP2 param groups, while entered.

    ``modules``: count only the FSDP units in these modules (e.g. one model of several in
    the process); default every param group that changes state while entered.
    ``peak_bytes`` is the largest sample since the first entry (or :meth:`reset`);
    ``peak_param_bytes`` and ``peak_grad_bytes`` are the largest of each part alone.
    Entering again keeps the peaks, so a tracker can measure a chosen set of steps.
    """

    def __init__(self, modules: Iterable[nn.Module] | None = None) -> None:
        self.peak_bytes = 0
        self.peak_param_bytes = 0
        self.peak_grad_bytes = 0
        self.samples = 0
        self._modules = None if modules is None else list(modules)
        self._groups: dict[int, FSDPParamGroup] = {}
        self._originals: dict[str, Any] = {}

    def reset(self) -> None:
        self.peak_bytes = self.peak_param_bytes = self.peak_grad_bytes = 0
        self.samples = 0

    def _sample(self, group: FSDPParamGroup) -> None:
        if self._modules is not None and id(group) not in self._groups:
            return
        self._groups.setdefault(id(group), group)
        self.samples += 1
        params, grads = live_unsharded_split(list(self._groups.values()))
        self.peak_bytes = max(self.peak_bytes, params + grads)
        self.peak_param_bytes = max(self.peak_param_bytes, params)
        self.peak_grad_bytes = max(self.peak_grad_bytes, grads)

    def __enter__(self) -> UnshardedBytesTracker:
        if self._modules is not None:
            self._groups = {
                id(g): g for root in self._modules for unit in fsdp_units(root) for g in unit.groups
            }
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
