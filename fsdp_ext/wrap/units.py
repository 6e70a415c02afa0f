"""The plan's data and its builders: units, their sizes and positions, the peak they imply.

A unit is a group of modules sharded together (``fully_shard([a, b])``): one module for
most policies, tied modules together, and adjacent siblings when a memory budget makes
grouping pay (:mod:`fsdp_ext.wrap.search`). :func:`build_plan` turns a list of groups into
a :class:`WrapPlan`; the peak estimate (:mod:`fsdp_ext.wrap.peak`) replays FSDP2's
gather/free schedule over unsharded parameters and gradients. Nothing here touches
storage, so a model built on the meta device plans exactly as the real one.

Imports run one way: tree -> policy -> cost/peak -> units -> search -> plan -> apply.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from fsdp_ext._torch import (
    auto_reshard_after_forward,
    fsdp_params,
    fsdp_state_id,
    fsdp_units,
    gather_dtype,
    gathered_bytes,
    group_reshard_after_forward,
    param_group,
    sharded_param,
)
from fsdp_ext.wrap.cost import CostModel
from fsdp_ext.wrap.peak import UnitSpan, estimate_peak
from fsdp_ext.wrap.policy import granularity_units, group_tied_units
from fsdp_ext.wrap.tree import ModuleInfo, repeated_blocks

__all__ = [
    "Atom",
    "Group",
    "Layout",
    "Unit",
    "WrapPlan",
    "build_plan",
    "default_units",
    "fsdp_unsharded_bytes",
    "keep_last_unit",
    "make_atoms",
    "per_block_units",
    "root_reshard_after_forward",
    "spans_for",
    "unit_groups",
    "unit_reshard_after_forward",
]

Group = tuple[nn.Module, ...]


class Unit(NamedTuple):
    """One FSDP unit: ``numel`` counts the parameters it manages (not nested units').

    ``fqn`` joins a group's member names with ``+``; ``members`` lists them.
    """

    fqn: str
    numel: int
    granularity: int | None
    members: tuple[str, ...] = ()


@dataclass
class WrapPlan:
    """Units in forward order, the root (fqn ``""``) first; ``str(plan)`` is a table.

    ``modules[i]`` holds the member modules of ``units[i + 1]``.
    ``reshard_after_forward[i]`` is that unit's setting (None: fully_shard's argument).
    ``peak_bytes``: estimated peak of unsharded parameters and gradients (one rank).
    ``cost_s``: modelled FSDP seconds per step (budget plans); ``baseline``: the plan
    ``GranularityPolicy()`` makes (one unit per block), costed the same way, for comparison.
    """

    units: list[Unit]
    unit_bytes: list[int]
    peak_bytes: int
    param_dtype: torch.dtype | None
    threshold: int | None
    policy: str
    modules: list[Group] = field(repr=False, default_factory=list)
    folded: list[str] = field(default_factory=list)  # units the budget let the root absorb
    reshard_after_forward: list[bool | int | None] = field(default_factory=list)
    forward_prefetch: int = 0
    backward_prefetch: int = 1
    peak_phase: str = ""
    cost_s: float | None = None
    cost_model: CostModel | None = None
    baseline: WrapPlan | None = field(default=None, repr=False)

    def summary(self) -> str:
        groups = sum(1 for g in self.modules if len(g) > 1)
        raf_off = sum(1 for r in self.reshard_after_forward if r is False)
        text = (
            f"{len(self.units)} units (root included, {groups} grouped), peak {self.peak_bytes} B "
            f"({self.peak_phase}), prefetch forward {self.forward_prefetch} / backward "
            f"{self.backward_prefetch}, kept after forward {raf_off}"
        )
        if self.cost_s is not None:
            text += f", modelled FSDP cost {1000 * self.cost_s:.2f} ms/step"
        return text

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
        if self.cost_s is not None:
            lines.append(f"plan: {self.summary()}")
            if self.baseline is not None:
                lines.append(f"GranularityPolicy() plan: {self.baseline.summary()}")
            if self.cost_model is not None:
                lines.append(f"cost model: {self.cost_model}")
        lines.append(
            f"{len(self.units)} units (root included); estimated peak unsharded bytes: "
            f"{self.peak_bytes} (param dtype {dtype})"
        )
        return "\n".join(lines)


# ---------------------------------------------------------------- sizes and positions


class Layout:
    """Pre-order positions of a model's modules: ``pos`` and the last descendant's ``end``."""

    def __init__(self, root: nn.Module) -> None:
        self.pos: dict[nn.Module, int] = {}
        self.end: dict[nn.Module, int] = {}
        self.parent: dict[nn.Module, nn.Module | None] = {root: None}

        def visit(module: nn.Module) -> int:
            self.pos[module] = len(self.pos)
            last = self.pos[module]
            for child in module.children():
                if child not in self.pos:
                    self.parent[child] = module
                    last = max(last, visit(child))
            self.end[module] = last
            return last

        visit(root)
        # Where each parameter's gradient appears in backward: its last user in forward.
        self.param_pos: dict[nn.Parameter, int] = {}
        for module, position in self.pos.items():
            for param in module.parameters(recurse=False):
                self.param_pos[param] = max(self.param_pos.get(param, -1), position)


def fsdp_unsharded_bytes(root: nn.Module) -> dict[int, int]:
    """Unsharded bytes of parameters that FSDP units created before planning manage.

    Their registered parameters are shards; FSDP gathers ``_orig_size`` (the local,
    post-EP/TP size) in the parameter dtype of the unit's mixed-precision policy.
    """
    sizes: dict[int, int] = {}
    for unit in fsdp_units(root):
        for group in unit.groups:
            for p in fsdp_params(group):
                sizes[id(sharded_param(p))] = gathered_bytes(p, gather_dtype(group, p))
    return sizes


def param_bytes(
    param: torch.Tensor, param_dtype: torch.dtype | None, fsdp_sizes: dict[int, int]
) -> int:
    """Bytes FSDP gathers for ``param``: local (post-EP/TP) size for a DTensor."""
    if id(param) in fsdp_sizes:
        return fsdp_sizes[id(param)]
    numel = param.to_local().numel() if isinstance(param, DTensor) else param.numel()
    return numel * (param_dtype or param.dtype).itemsize


def managed_params(
    root: nn.Module, groups: list[Group], layout: Layout
) -> list[list[nn.Parameter]]:
    """Parameters each unit manages, root first: inner units claim theirs first (FSDP2)."""
    claimed: set[nn.Parameter] = set()
    managed: list[list[nn.Parameter]] = [[] for _ in groups]
    for i in sorted(range(len(groups)), key=lambda i: -layout.pos[groups[i][0]]):
        own: list[nn.Parameter] = []
        for member in groups[i]:
            own += [p for p in member.parameters() if p not in claimed]
            claimed.update(own)
        managed[i] = own
    root_own = [p for p in root.parameters() if p not in claimed]
    return [root_own, *managed]


def padded_param_bytes(param_nbytes: int, param: torch.Tensor, world_size: int) -> int:
    """``param_nbytes`` after FSDP pads dim 0 to a multiple of ``world_size`` (what an int
    ``reshard_after_forward`` keeps a ``1/r`` slice of)."""
    shape = param.to_local().shape if isinstance(param, DTensor) else param.shape
    if not shape or shape[0] == 0:
        return param_nbytes
    dim0 = shape[0]
    return param_nbytes // dim0 * (-(-dim0 // world_size) * world_size)


@dataclass
class Atom:
    """A planned unit's facts for the peak model (``grads``: (position, bytes)).

    ``padded``: ``nbytes`` with each parameter's dim 0 padded to a multiple of the world.
    """

    group: Group
    params: list[nn.Parameter]
    nbytes: int
    start: int
    end: int
    grads: dict[int, int]
    padded: int = 0


def make_atoms(
    root: nn.Module,
    groups: list[Group],
    layout: Layout,
    param_dtype: torch.dtype | None,
    fsdp_sizes: dict[int, int],
    world_size: int = 1,
) -> tuple[Atom, list[Atom]]:
    """The root's and each group's atom."""
    managed = managed_params(root, groups, layout)
    atoms = []
    for group, params in zip([(root,), *groups], managed, strict=True):
        grads: dict[int, int] = {}
        total = padded = 0
        for p in params:
            nbytes = param_bytes(p, param_dtype, fsdp_sizes)
            total += nbytes
            padded += padded_param_bytes(nbytes, p, world_size)
            if p.requires_grad:
                where = layout.param_pos.get(p, layout.pos[group[0]])
                grads[where] = grads.get(where, 0) + nbytes
        start = min(layout.pos[m] for m in group)
        end = max(layout.end[m] for m in group)
        atoms.append(Atom(group, params, total, start, end, grads, padded))
    return atoms[0], atoms[1:]


def spans_for(
    root_atom: Atom,
    units: list[list[Atom]],
    raf: list[bool | int],
    folded: list[Atom] = (),
    root_raf: bool | int = False,
) -> list[UnitSpan]:
    """UnitSpans of a plan: ``units`` (each a list of atoms sharded together) below the
    root; ``folded`` atoms' parameters join the root. A non-root unit's gradients are
    placed at its output (conservative with nesting); the root's where they appear."""
    root_grads = dict(root_atom.grads)
    for atom in folded:
        for pos, nbytes in atom.grads.items():
            root_grads[pos] = root_grads.get(pos, 0) + nbytes
    spans = [
        UnitSpan(
            "<root>",
            root_atom.nbytes + sum(a.nbytes for a in folded),
            root_atom.start,
            root_atom.end,
            tuple(root_grads.items()),
            root_raf,
            root_atom.padded + sum(a.padded for a in folded),
        )
    ]
    for atoms, setting in zip(units, raf, strict=True):
        start = min(a.start for a in atoms)
        end = max(a.end for a in atoms)
        grad_bytes = sum(sum(a.grads.values()) for a in atoms)
        name = "+".join(str(a.start) for a in atoms)
        nbytes, padded = sum(a.nbytes for a in atoms), sum(a.padded for a in atoms)
        spans.append(UnitSpan(name, nbytes, start, end, ((end, grad_bytes),), setting, padded))
    return spans


def existing_reshard_after_forward(module: nn.Module) -> bool | int:
    """The setting a unit sharded before planning was given."""
    return group_reshard_after_forward(param_group(module))


def root_reshard_after_forward(root: nn.Module, default: bool | int | None) -> bool | int:
    """FSDP2 keeps the root gathered after forward only when the argument was None."""
    if isinstance(root, FSDPModule):
        if auto_reshard_after_forward(root):
            return False
        return existing_reshard_after_forward(root)
    return False if default is None else default


def _effective_raf(setting: bool | int | None) -> bool | int:
    return True if setting is None else setting


def build_plan(
    root: nn.Module,
    groups: list[Group],
    infos: dict[nn.Module, ModuleInfo],
    layout: Layout,
    *,
    param_dtype: torch.dtype | None,
    threshold: int | None,
    policy: str,
    raf: list[bool | int | None],
    fsdp_sizes: dict[int, int],
    folded: list[Group] = (),
    forward_prefetch: int = 0,
    backward_prefetch: int = 1,
    cost_model: CostModel | None = None,
    world_size: int = 2,
    default_raf: bool | int | None = None,
) -> WrapPlan:
    root_atom, atoms = make_atoms(
        root, [*groups, *folded], layout, param_dtype, fsdp_sizes, world_size
    )
    atoms, folded_atoms = atoms[: len(groups)], atoms[len(groups) :]
    settings = [_effective_raf(r) for r in raf]
    root_raf = root_reshard_after_forward(root, default_raf)
    spans = spans_for(root_atom, [[a] for a in atoms], settings, folded_atoms, root_raf)
    peak = estimate_peak(
        spans, forward_prefetch=forward_prefetch, backward_prefetch=backward_prefetch
    )
    unit_bytes = [s.param_bytes for s in spans]
    root_numel = sum(p.numel() for p in root_atom.params) + sum(
        p.numel() for a in folded_atoms for p in a.params
    )
    rows = [Unit("", root_numel, infos[root].granularity)]
    for atom in atoms:
        names = tuple(infos[m].fqn for m in atom.group)
        granularity = infos[atom.group[0]].granularity if len(names) == 1 else None
        rows.append(Unit("+".join(names), sum(p.numel() for p in atom.params), granularity, names))
    cost = None
    if cost_model is not None:
        cost = cost_model.step_s(
            unit_bytes,
            [root_raf, *settings],
            world_size,
            forward_prefetch=forward_prefetch,
            backward_prefetch=backward_prefetch,
        )
    return WrapPlan(
        units=rows,
        unit_bytes=unit_bytes,
        peak_bytes=peak.bytes,
        param_dtype=param_dtype,
        threshold=threshold,
        policy=policy,
        modules=list(groups),
        folded=["+".join(infos[m].fqn for m in g) for g in folded],
        reshard_after_forward=list(raf),
        forward_prefetch=forward_prefetch,
        backward_prefetch=backward_prefetch,
        peak_phase=peak.phase,
        cost_s=cost,
        cost_model=cost_model,
    )


# ---------------------------------------------------------------- unit selection


def default_units(
    root: nn.Module, infos: dict[nn.Module, ModuleInfo]
) -> tuple[list[nn.Module], int]:
    """One unit per repeated block, plus the leftovers at the blocks' granularity."""
    blocks, ancestors = repeated_blocks(root)
    sizes = [infos[b].granularity for b in blocks if infos[b].numel]
    threshold = max((g for g in sizes if g is not None), default=0)
    return granularity_units(root, threshold, infos, ancestors), threshold


def per_block_units(
    root: nn.Module, infos: dict[nn.Module, ModuleInfo]
) -> tuple[list[nn.Module], int]:
    """``GranularityPolicy()``'s units: one per repeated block, the leftovers in the root.

    A leftover unit (the embeddings, a lone final norm, the output layer) costs its hooks,
    three collectives' latency and a second all-gather of its bytes every step, and buys
    only memory: the root holds it unsharded. Without a memory budget there is nothing to
    buy, so the leftovers stay in the root, as in the per-block wrap; a budget
    (``memory_budget_bytes``) weighs them as units again. Without repeated blocks every
    indivisible module stays a unit (:func:`default_units`).
    """
    units, threshold = default_units(root, infos)
    blocks, _ = repeated_blocks(root)
    if not blocks:
        return units, threshold
    inside = {m for b in blocks for m in b.modules()}
    return [u for u in units if u in inside], threshold


def keep_last_unit(
    plan: WrapPlan,
    raf: list[bool | int | None],
    groups: list[Group],
    default: bool | int | None,
    plan_with: Callable[[list[bool | int | None]], WrapPlan],
) -> WrapPlan:
    """The default plan keeps its last unit gathered after forward (its backward comes
    next, so a backward all-gather is saved) where the estimated peak does not grow and the
    caller left ``reshard_after_forward`` unset. ``plan_with(raf)`` builds a plan."""
    if default is not None or not groups or raf[-1] is not None:
        return plan
    if any(isinstance(m, FSDPModule) for m in groups[-1]):
        return plan
    kept = plan_with([*raf[:-1], False])
    return kept if kept.peak_bytes <= plan.peak_bytes else plan


def unit_reshard_after_forward(
    group: Group, default: bool | int | None, overrides: dict[nn.Module, dict]
) -> bool | int | None:
    """A unit's setting: its existing FSDP state, a CustomPolicy dict, or the default."""
    if isinstance(group[0], FSDPModule):
        return existing_reshard_after_forward(group[0])
    return overrides.get(group[0], {}).get("reshard_after_forward", default)


def with_existing_units(root: nn.Module, units: list[nn.Module]) -> list[nn.Module]:
    """Add submodules that are FSDP units already (e.g. experts on their own mesh).

    They manage their own parameters, so the units around them must not count them, and
    they are unsharded in turn like any other unit: both matter to the peak estimate.
    """
    selected = set(units) | {m for unit in fsdp_units(root) for m in unit.modules}
    return [m for m in root.modules() if m is not root and m in selected]


def unit_groups(root: nn.Module, units: list[nn.Module]) -> list[Group]:
    """``units`` and the FSDP units already there, as groups: tied modules together
    (:func:`group_tied_units`), and the members of one existing unit together
    (``fully_shard([norm, lm_head])`` before planning is one unit, not two)."""
    merged: dict[int, list[nn.Module]] = {}
    out: list[list[nn.Module]] = []
    for group in group_tied_units(root, with_existing_units(root, units)):
        head = group[0]
        state = fsdp_state_id(head) if isinstance(head, FSDPModule) else None
        if state is not None and state in merged:
            merged[state].extend(group)
            continue
        members = list(group)
        if state is not None:
            merged[state] = members
        out.append(members)
    order = {m: i for i, m in enumerate(root.modules())}
    return [tuple(sorted(g, key=order.__getitem__)) for g in out]
