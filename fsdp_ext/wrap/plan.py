"""Dry-run planning: which units a policy makes, their sizes, and the peak they imply.

Nothing here touches storage, so a model built on the meta device plans exactly as the
real one. The peak estimate is what FSDP2 holds unsharded at once: the root's leftover
parameters (the root is not resharded after forward), plus the two largest adjacent
units in forward order (the one computing and the one prefetched next).

With a memory budget, units that fit the budget's slack are folded into the root,
smallest first. The root is gathered once per step and kept until backward ends, so a
folded unit saves two all-gathers, a reduce-scatter and its hooks, and costs its bytes
for the whole step: DeepSpeed's ``stage3_param_persistence_threshold``, sized by the
budget the user gave rather than by a parameter count.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from fsdp_ext.wrap.policy import GranularityPolicy, granularity_units, select_units
from fsdp_ext.wrap.tree import ModuleInfo, module_infos, repeated_blocks


class Unit(NamedTuple):
    """One FSDP unit: ``numel`` counts the parameters it manages (not nested units')."""

    fqn: str
    numel: int
    granularity: int | None


@dataclass
class WrapPlan:
    """Units in forward order, the root (fqn ``""``) first; ``str(plan)`` is a table.

    ``modules`` holds the unit modules below the root, in the order of ``units[1:]``.
    """

    units: list[Unit]
    unit_bytes: list[int]
    peak_bytes: int
    param_dtype: torch.dtype | None
    threshold: int | None
    policy: str
    modules: list[nn.Module] = field(repr=False, default_factory=list)
    folded: list[str] = field(default_factory=list)  # units the budget let the root absorb

    def __str__(self) -> str:
        width = max([len("fqn"), *(len(u.fqn or "<root>") for u in self.units)])
        header = f"{'fqn':<{width}}  {'numel':>12}  {'granularity':>12}  {'bytes':>12}"
        lines = [f"policy: {self.policy}", header, "-" * len(header)]
        for unit, nbytes in zip(self.units, self.unit_bytes, strict=True):
            granularity = "-" if unit.granularity is None else str(unit.granularity)
            name = unit.fqn or "<root>"
            lines.append(f"{name:<{width}}  {unit.numel:>12}  {granularity:>12}  {nbytes:>12}")
        dtype = "as stored" if self.param_dtype is None else str(self.param_dtype)
        if self.folded:
            shown = ", ".join(self.folded[:6]) + (", ..." if len(self.folded) > 6 else "")
            lines.append(f"folded into the root within the budget: {len(self.folded)} ({shown})")
        lines.append(
            f"{len(self.units)} units (root included); estimated peak unsharded bytes: "
            f"{self.peak_bytes} (param dtype {dtype})"
        )
        return "\n".join(lines)


def _param_bytes(param: torch.Tensor, param_dtype: torch.dtype | None) -> int:
    return param.numel() * (param_dtype or param.dtype).itemsize


def _managed_params(root: nn.Module, units: list[nn.Module]) -> list[list[nn.Parameter]]:
    """Parameters each unit manages, root last: inner units claim theirs first (FSDP2)."""
    claimed: set[nn.Parameter] = set()
    managed: dict[nn.Module, list[nn.Parameter]] = {}
    for module in [*reversed(units), root]:
        own = [p for p in module.parameters() if p not in claimed]
        claimed.update(own)
        managed[module] = own
    return [managed[root], *(managed[m] for m in units)]


def estimate_peak_bytes(unit_bytes: list[int]) -> int:
    """Root leftovers + the largest pair of adjacent units (computing + prefetched)."""
    root_bytes, rest = unit_bytes[0], unit_bytes[1:]
    pairs = [a + b for a, b in itertools.pairwise(rest)] or rest or [0]
    return root_bytes + max(pairs)


def fold_into_root(unit_bytes: list[int], foldable: list[bool], budget: int) -> list[bool]:
    """Which units below the root stay units once the smallest are folded into the root
    while the estimated peak stays within ``budget`` (``unit_bytes[0]`` is the root's)."""
    root, rest = unit_bytes[0], unit_bytes[1:]
    keep = [True] * len(rest)
    for i in sorted(range(len(rest)), key=rest.__getitem__):
        if not foldable[i]:
            continue
        keep[i] = False
        trial = [root + rest[i], *(b for b, k in zip(rest, keep, strict=True) if k)]
        if estimate_peak_bytes(trial) <= budget:
            root += rest[i]
        else:
            keep[i] = True
    return keep


def _plan_for_units(
    root: nn.Module,
    units: list[nn.Module],
    infos: dict[nn.Module, ModuleInfo],
    param_dtype: torch.dtype | None,
    threshold: int | None,
    policy: str,
    folded: list[str] | None = None,
) -> WrapPlan:
    managed = _managed_params(root, units)
    unit_bytes = [sum(_param_bytes(p, param_dtype) for p in ps) for ps in managed]
    rows = [
        Unit(infos[m].fqn, sum(p.numel() for p in ps), infos[m].granularity)
        for m, ps in zip([root, *units], managed, strict=True)
    ]
    return WrapPlan(
        units=rows,
        unit_bytes=unit_bytes,
        peak_bytes=estimate_peak_bytes(unit_bytes),
        param_dtype=param_dtype,
        threshold=threshold,
        policy=policy,
        modules=list(units),
        folded=folded or [],
    )


def resolve_threshold(
    root: nn.Module,
    policy: GranularityPolicy,
    param_dtype: torch.dtype | None,
    infos: dict[nn.Module, ModuleInfo],
) -> int:
    """The threshold a GranularityPolicy means for this model (budget search if asked)."""
    if policy.threshold is not None:
        return policy.threshold
    if policy.memory_budget_bytes is None:
        blocks = repeated_blocks(root)[0]
        return max((infos[b].granularity for b in blocks if infos[b].numel), default=0)
    budget = policy.memory_budget_bytes
    granularities = sorted(
        {info.granularity for info in infos.values() if info.granularity is not None},
        reverse=True,
    )
    # Below every granularity: every indivisible module its own unit, the finest plan.
    finest_threshold = min(granularities, default=0) - 1
    finest = _plan_for_units(
        root, granularity_units(root, finest_threshold, infos), infos, param_dtype, None, ""
    )
    largest = max(range(len(finest.units)), key=lambda i: finest.unit_bytes[i])
    if finest.unit_bytes[largest] > budget:
        name = finest.units[largest].fqn or "<root leftovers>"
        raise ValueError(
            f"memory_budget_bytes={budget} is smaller than the largest indivisible module "
            f"{name!r} ({finest.unit_bytes[largest]} bytes unsharded); allowed: >= "
            f"{finest.peak_bytes} bytes for this model"
        )
    for threshold in [*granularities, finest_threshold]:
        units = granularity_units(root, threshold, infos)
        if _plan_for_units(root, units, infos, param_dtype, None, "").peak_bytes <= budget:
            return threshold
    raise ValueError(
        f"memory_budget_bytes={budget} is below the smallest peak any threshold reaches "
        f"({finest.peak_bytes} bytes unsharded, every indivisible module its own unit); "
        f"allowed: >= {finest.peak_bytes}"
    )


def param_dtype_of(mp_policy: object | None) -> torch.dtype | None:
    return getattr(mp_policy, "param_dtype", None) if mp_policy is not None else None


def plan_units(
    module: nn.Module, auto_wrap_policy: object = None, *, mp_policy: object | None = None
) -> WrapPlan:
    """Dry run of :func:`fsdp_ext.fully_shard`: the units, their sizes, the peak estimate.

    Works on a meta-device model. ``auto_wrap_policy=None`` plans the root alone, as
    torch's fully_shard does. ``mp_policy`` (a ``MixedPrecisionPolicy``) sets the
    dtype bytes are counted in, as the unsharded parameters will have that dtype.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
    param_dtype = param_dtype_of(mp_policy)
    infos = module_infos(module)
    threshold = None
    if isinstance(auto_wrap_policy, GranularityPolicy):
        threshold = resolve_threshold(module, auto_wrap_policy, param_dtype, infos)
        policy = auto_wrap_policy
        is_default = policy.threshold is None and policy.memory_budget_bytes is None
        descend = repeated_blocks(module)[1] if is_default else frozenset()
        units = granularity_units(module, threshold, infos, descend)
    else:
        units = select_units(module, auto_wrap_policy)
    units = _with_existing_units(module, units)
    description = _describe(auto_wrap_policy, threshold)
    plan = _plan_for_units(module, units, infos, param_dtype, threshold, description)
    budget = getattr(auto_wrap_policy, "memory_budget_bytes", None)
    if budget is None:
        return plan
    # Units sharded already (by the caller) cannot be folded back into the root.
    keep = fold_into_root(plan.unit_bytes, [not isinstance(m, FSDPModule) for m in units], budget)
    kept = [m for m, k in zip(units, keep, strict=True) if k]
    folded = [infos[m].fqn for m, k in zip(units, keep, strict=True) if not k]
    return _plan_for_units(module, kept, infos, param_dtype, threshold, description, folded)


def _with_existing_units(root: nn.Module, units: list[nn.Module]) -> list[nn.Module]:
    """Add submodules that are FSDP units already (e.g. experts on their own mesh).

    They manage their own parameters, so the units around them must not count them, and
    they are unsharded in turn like any other unit: both matter to the peak estimate.
    """
    selected = set(units)
    return [
        m for m in root.modules() if m is not root and (m in selected or isinstance(m, FSDPModule))
    ]


def _describe(policy: object, threshold: int | None) -> str:
    text = repr(policy)
    return text if threshold is None else f"{text} -> threshold {threshold}"
