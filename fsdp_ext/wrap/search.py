"""Budget planning: the cheapest plan, by the cost model, whose estimated peak fits.

The search space, per candidate set of base units (the per-block units, then the
granularity thresholds from coarse to fine):

* adjacent sibling units grouped into one unit, ``fully_shard([m1, m2, ...])``, in runs
  of at most k (k = 1 is no grouping);
* backward prefetch off (every unit prefetches only itself) or FSDP2's default of one,
  and forward prefetch of the next unit or none; prefetch only pays where collectives
  overlap compute (``CostModel.overlap`` > 0), so with gloo on CPU it is off;
* ``reshard_after_forward=False`` on the last 0, 1 or 2 units (their backward follows
  their forward closely), unless the caller fixed ``reshard_after_forward``;
* then the smallest top-level units folded into the root while the peak still fits.

Each candidate's peak comes from :func:`fsdp_ext.wrap.peak.estimate_peak` and its cost from
:class:`fsdp_ext.wrap.cost.CostModel`; the lowest cost wins (costs within a relative
``COST_RTOL`` tie), then the lowest peak. Finer base units are searched until two levels
past the first that fits.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from fsdp_ext.wrap.cost import CostModel
from fsdp_ext.wrap.peak import estimate_peak
from fsdp_ext.wrap.policy import GranularityPolicy, granularity_units
from fsdp_ext.wrap.tree import ModuleInfo
from fsdp_ext.wrap.units import (
    Atom,
    Group,
    Layout,
    WrapPlan,
    build_plan,
    default_units,
    keep_last_unit,
    make_atoms,
    per_block_units,
    root_reshard_after_forward,
    spans_for,
    unit_groups,
    unit_reshard_after_forward,
)

_GROUP_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
# A plan's modelled cost is a sum of float terms taken in an order that depends on the
# plan, so plans of equal cost differ in the last bits: within this relative tolerance
# they tie, and the lower peak wins (float noise must not pick a plan with a higher peak).
COST_RTOL = 1e-9


@dataclass
class _Candidate:
    cost: float
    peak: int
    threshold: int | None
    groups: list[Group]
    folded: list[Group]
    raf: list[bool | int | None]
    forward_prefetch: int
    backward_prefetch: int


def _sibling_runs(atoms: list[Atom], layout: Layout) -> list[list[int]]:
    """Maximal runs of consecutive single-module units with the same parent."""
    runs: list[list[int]] = []
    for i, atom in enumerate(atoms):
        single = len(atom.group) == 1 and not isinstance(atom.group[0], FSDPModule)
        parent = layout.parent[atom.group[0]] if single else None
        if single and runs and runs[-1] and runs[-1][-1] == i - 1:
            prev = atoms[i - 1].group[0]
            if layout.parent[prev] is parent and len(atoms[i - 1].group) == 1:
                runs[-1].append(i)
                continue
        runs.append([i] if single else [])
    return [r for r in runs if r]


def _chunk(run: list[int], k: int) -> list[list[int]]:
    n = math.ceil(len(run) / k)
    base, extra = divmod(len(run), n)
    out, at = [], 0
    for c in range(n):
        size = base + (1 if c < extra else 0)
        out.append(run[at : at + size])
        at += size
    return out


def _groupings(atoms: list[Atom], layout: Layout) -> list[list[list[int]]]:
    """Unit lists (each unit a list of atom indices, in pre-order), one per k."""
    runs = _sibling_runs(atoms, layout)
    in_run = {i: r for r in runs for i in r}
    longest = max((len(r) for r in runs), default=1)
    sizes = sorted({k for k in _GROUP_SIZES if k <= longest} | {longest})
    out = []
    for k in sizes:
        units: list[list[int]] = []
        done: set[int] = set()
        for i in range(len(atoms)):
            if i in done:
                continue
            if i in in_run:
                units += _chunk(in_run[i], k)
                done.update(in_run[i])
            else:
                units.append([i])
        out.append(units)
    return out


def plan_for_budget(
    root: nn.Module,
    policy: GranularityPolicy,
    infos: dict[nn.Module, ModuleInfo],
    layout: Layout,
    *,
    param_dtype: torch.dtype | None,
    reshard_after_forward: bool | int | None,
    fsdp_sizes: dict[int, int],
    world_size: int,
) -> WrapPlan:
    budget = policy.memory_budget_bytes
    model = policy.cost_model or CostModel()
    root_raf = root_reshard_after_forward(root, reshard_after_forward)
    common = dict(param_dtype=param_dtype, fsdp_sizes=fsdp_sizes, world_size=world_size)
    block_units, block_threshold = default_units(root, infos)
    # What GranularityPolicy() builds (one unit per block, the leftovers in the root, the
    # last unit kept where that costs no peak), so the printout compares the budget plan
    # with the default.
    default_groups = unit_groups(root, per_block_units(root, infos)[0])
    default_raf = [unit_reshard_after_forward(g, reshard_after_forward, {}) for g in default_groups]

    def default_plan(settings: list[bool | int | None]) -> WrapPlan:
        return build_plan(
            root,
            default_groups,
            infos,
            layout,
            threshold=block_threshold,
            policy="GranularityPolicy()",
            raf=settings,
            cost_model=model,
            default_raf=reshard_after_forward,
            **common,
        )

    baseline = keep_last_unit(
        default_plan(default_raf),
        default_raf,
        default_groups,
        reshard_after_forward,
        default_plan,
    )
    granularities = sorted(
        {i.granularity for i in infos.values() if i.granularity is not None}, reverse=True
    )
    finest = min(granularities, default=0) - 1
    levels = [(block_units, block_threshold)]
    levels += [(granularity_units(root, t, infos), t) for t in [*granularities, finest]]
    prefetch = [(0, 0)] if model.overlap == 0 else [(0, 0), (0, 1), (1, 0), (1, 1)]
    keeps = (0, 1, 2) if reshard_after_forward is None else (0,)
    best: _Candidate | None = None
    smallest_peak, seen, fitting_levels = None, set(), 0
    for units, threshold in levels:
        key = tuple(map(id, units))
        if key in seen:
            continue
        seen.add(key)
        groups = unit_groups(root, units)
        root_atom, atoms = make_atoms(root, groups, layout, param_dtype, fsdp_sizes, world_size)
        fixed = [unit_reshard_after_forward(g, reshard_after_forward, {}) for g in groups]
        level_fits = False
        for grouping, (fwd, bwd), keep in itertools.product(
            _groupings(atoms, layout), prefetch, keeps
        ):
            # The last ``keep`` units stay gathered after forward (units sharded before
            # planning keep their own setting).
            raf = [
                False
                if j >= len(grouping) - keep and not isinstance(atoms[u[0]].group[0], FSDPModule)
                else fixed[u[0]]
                for j, u in enumerate(grouping)
            ]
            candidate = _fit_and_fold(
                root_atom,
                atoms,
                grouping,
                raf,
                fwd,
                bwd,
                budget,
                model,
                world_size,
                layout,
                root_raf,
                try_keep=reshard_after_forward is None,
            )
            if isinstance(candidate, int):
                smallest_peak = (
                    candidate if smallest_peak is None else min(smallest_peak, candidate)
                )
                continue
            level_fits = True
            cost, peak, kept, folded, kept_raf = candidate
            if best is None or _better(cost, peak, best.cost, best.peak):
                best = _Candidate(
                    cost,
                    peak,
                    threshold,
                    [tuple(m for i in u for m in atoms[i].group) for u in kept],
                    [tuple(m for i in u for m in atoms[i].group) for u in folded],
                    kept_raf,
                    fwd,
                    bwd,
                )
        fitting_levels += level_fits or fitting_levels > 0
        if fitting_levels >= 3:
            break
    if best is None:
        raise ValueError(
            f"memory_budget_bytes={budget} is below the smallest estimated peak of any plan "
            f"({smallest_peak} bytes of unsharded parameters and gradients, every "
            f"indivisible module its own unit); allowed: >= {smallest_peak}"
        )
    plan = build_plan(
        root,
        best.groups,
        infos,
        layout,
        threshold=best.threshold,
        policy=f"{policy!r} -> threshold {best.threshold}",
        raf=best.raf,
        folded=best.folded,
        forward_prefetch=best.forward_prefetch,
        backward_prefetch=best.backward_prefetch,
        cost_model=model,
        default_raf=reshard_after_forward,
        **common,
    )
    plan.baseline = baseline
    return plan


def _better(cost: float, peak: int, best_cost: float, best_peak: int) -> bool:
    """Cheaper beyond ``COST_RTOL``, or as cheap within it and lower in peak."""
    if math.isclose(cost, best_cost, rel_tol=COST_RTOL):
        return peak < best_peak
    return cost < best_cost


def _fit_and_fold(
    root_atom: Atom,
    atoms: list[Atom],
    grouping: list[list[int]],
    raf: list[bool | int | None],
    fwd: int,
    bwd: int,
    budget: int,
    model: CostModel,
    world_size: int,
    layout: Layout,
    root_raf: bool | int,
    *,
    try_keep: bool = False,
) -> tuple[float, int, list[list[int]], list[list[int]], list[bool | int | None]] | int:
    """(cost, peak, kept units, folded units, their settings) of a fitting plan, or its
    peak if none fits. With ``try_keep``, the last one or two units left after folding
    are also tried kept after forward (one all-gather fewer each)."""
    settings = [True if r is None else r for r in raf]

    def peak_of(keep: list[bool], settings: list[bool | int] = settings) -> int:
        units = [[atoms[i] for i in u] for u, k in zip(grouping, keep, strict=True) if k]
        folded = [atoms[i] for u, k in zip(grouping, keep, strict=True) if not k for i in u]
        spans = spans_for(
            root_atom,
            units,
            [s for s, k in zip(settings, keep, strict=True) if k],
            folded,
            root_raf,
        )
        return estimate_peak(spans, forward_prefetch=fwd, backward_prefetch=bwd).bytes

    keep = [True] * len(grouping)
    peak = peak_of(keep)
    if peak > budget:
        return peak
    unit_bytes = [sum(atoms[i].nbytes for i in u) for u in grouping]
    unit_of = {m: j for j, u in enumerate(grouping) for i in u for m in atoms[i].group}

    def is_top_level(j: int) -> bool:
        """Not inside another unit (its parameters would go there, not to the root)."""
        module = layout.parent[atoms[grouping[j][0]].group[0]]
        while module is not None:
            if unit_of.get(module, j) != j:
                return False
            module = layout.parent[module]
        return not any(isinstance(m, FSDPModule) for i in grouping[j] for m in atoms[i].group)

    top_level = [is_top_level(j) for j in range(len(grouping))]
    for idx in sorted(range(len(grouping)), key=unit_bytes.__getitem__):
        if not top_level[idx] or unit_bytes[idx] > budget - peak:
            continue
        keep[idx] = False
        trial = peak_of(keep)
        if trial <= budget:
            peak = trial
        else:
            keep[idx] = True
    kept = [u for u, k in zip(grouping, keep, strict=True) if k]
    folded = [u for u, k in zip(grouping, keep, strict=True) if not k]
    root_bytes = root_atom.nbytes + sum(unit_bytes[i] for i, k in enumerate(keep) if not k)

    def cost_of(settings: list[bool | int]) -> float:
        return model.step_s(
            [root_bytes, *(b for b, k in zip(unit_bytes, keep, strict=True) if k)],
            [root_raf, *(s for s, k in zip(settings, keep, strict=True) if k)],
            world_size,
            forward_prefetch=fwd,
            backward_prefetch=bwd,
        )

    best = (cost_of(settings), peak, settings)
    kept_idx = [
        i
        for i, k in enumerate(keep)
        if k and not any(isinstance(m, FSDPModule) for j in grouping[i] for m in atoms[j].group)
    ]
    for last in (1, 2) if try_keep else ():
        trial = list(settings)
        for i in kept_idx[-last:]:
            trial[i] = False
        trial_peak = peak_of(keep, trial)
        if trial_peak <= budget and _better(cost_of(trial), trial_peak, *best[:2]):
            best = (cost_of(trial), trial_peak, trial)
    cost, peak, settings = best
    kept_raf = [
        r if s is not False else False for r, s, k in zip(raf, settings, keep, strict=True) if k
    ]
    return cost, peak, kept, folded, kept_raf
