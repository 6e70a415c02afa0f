"""Dry-run planning: which units a policy makes, their sizes, and the peak they imply.

:func:`plan_units` picks the units (a policy's selection, the granularity threshold, or a
budget search in :mod:`fsdp_ext.wrap.search`) and builds the plan with
:func:`fsdp_ext.wrap.units.build_plan`. It works on a meta-device model.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp.wrap import CustomPolicy

from fsdp_ext._torch import run_fsdp1_policy
from fsdp_ext.wrap.node_reshard import resolve_reshard_after_forward
from fsdp_ext.wrap.policy import GranularityPolicy, granularity_units, select_units
from fsdp_ext.wrap.search import plan_for_budget
from fsdp_ext.wrap.tree import module_infos
from fsdp_ext.wrap.units import (
    Layout,
    WrapPlan,
    build_plan,
    fsdp_unsharded_bytes,
    keep_last_unit,
    per_block_units,
    unit_groups,
    unit_reshard_after_forward,
)

__all__ = ["param_dtype_of", "plan_units"]


def param_dtype_of(mp_policy: object | None) -> torch.dtype | None:
    return getattr(mp_policy, "param_dtype", None) if mp_policy is not None else None


def _world_size(world_size: int | None) -> int:
    if world_size is not None:
        return world_size
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 2


def plan_units(
    module: nn.Module,
    auto_wrap_policy: object = None,
    *,
    mp_policy: object | None = None,
    reshard_after_forward: bool | int | str | None = None,
    world_size: int | None = None,
) -> WrapPlan:
    """Dry run of :func:`fsdp_ext.shard_by_policy`: the units, their sizes, the peak estimate.

    Works on a meta-device model. ``auto_wrap_policy=None`` plans the root alone, as
    torch's fully_shard does. ``mp_policy`` (a ``MixedPrecisionPolicy``) sets the
    dtype bytes are counted in; ``reshard_after_forward`` is fully_shard's argument
    (``"node"``: hpZ over ranks ``0 .. world_size - 1``, nodes from ``LOCAL_WORLD_SIZE``);
    ``world_size`` (default: the process group's, else 2) scales the modelled cost.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
    world = _world_size(world_size)
    reshard_after_forward = resolve_reshard_after_forward(reshard_after_forward, None, world)
    if reshard_after_forward is not None and not isinstance(reshard_after_forward, (bool, int)):
        raise TypeError(
            f"reshard_after_forward must be a bool, an int, None or 'node', got "
            f"{reshard_after_forward!r}"
        )
    param_dtype = param_dtype_of(mp_policy)
    infos = module_infos(module)
    layout = Layout(module)
    fsdp_sizes = fsdp_unsharded_bytes(module)
    if isinstance(auto_wrap_policy, GranularityPolicy) and auto_wrap_policy.memory_budget_bytes:
        return plan_for_budget(
            module,
            auto_wrap_policy,
            infos,
            layout,
            param_dtype=param_dtype,
            reshard_after_forward=reshard_after_forward,
            fsdp_sizes=fsdp_sizes,
            world_size=world,
        )
    threshold = None
    if isinstance(auto_wrap_policy, GranularityPolicy):
        if auto_wrap_policy.threshold is None:
            units, threshold = per_block_units(module, infos)
        else:
            threshold = auto_wrap_policy.threshold
            units = granularity_units(module, threshold, infos)
    else:
        units = select_units(module, auto_wrap_policy)
    groups = unit_groups(module, units)
    overrides: dict[nn.Module, dict] = {}
    if isinstance(auto_wrap_policy, CustomPolicy):
        overrides = run_fsdp1_policy(auto_wrap_policy, module)
    raf = [unit_reshard_after_forward(g, reshard_after_forward, overrides) for g in groups]

    def plan_with(settings: list[bool | int | None]) -> WrapPlan:
        return build_plan(
            module,
            groups,
            infos,
            layout,
            param_dtype=param_dtype,
            threshold=threshold,
            policy=_describe(auto_wrap_policy, threshold),
            raf=settings,
            fsdp_sizes=fsdp_sizes,
            world_size=world,
            default_raf=reshard_after_forward,
        )

    plan = plan_with(raf)
    if threshold is not None and auto_wrap_policy.threshold is None:
        plan = keep_last_unit(plan, raf, groups, reshard_after_forward, plan_with)
    return plan


def _describe(policy: object, threshold: int | None) -> str:
    text = repr(policy)
    return text if threshold is None else f"{text} -> threshold {threshold}"
