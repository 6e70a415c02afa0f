"""Each planned FSDP unit's parameter sizes, before ``fully_shard`` (hpZ is a ``fully_shard``
argument, so ``--comm auto`` decides before the model is sharded)."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

__all__ = ["unit_sizes"]


def unit_sizes(model: nn.Module, units: Sequence[Sequence[str]]) -> list[list[int]]:
    """Parameter numels per unit: ``units`` holds each unit's module names (a wrap plan's
    ``members``); a parameter belongs to the unit of its closest enclosing module, and what
    no unit holds to the root, returned first."""
    owner: dict[str, int] = {}
    for index, members in enumerate(units, start=1):
        for name in members:
            if name:
                owner[name] = index
    sizes: list[list[int]] = [[] for _ in range(len(units) + 1)]
    for name, param in model.named_parameters():
        parts = name.split(".")[:-1]
        index = 0
        for depth in range(len(parts), 0, -1):
            index = owner.get(".".join(parts[:depth]), 0)
            if index:
                break
        sizes[index].append(param.numel())
    return sizes
