"""Wrap policies: ours (granularity) and adapters that read FSDP1 policies unchanged.

Every policy is reduced to one question: which modules below the root become FSDP units?
:func:`granularity_units` answers it for a resolved threshold, :func:`select_units` for
every other policy. The FSDP1 adapters answer it with FSDP1's own
rules (``_Policy._run_policy`` for policy objects; the ``_recursive_wrap`` walk with its
``nonwrapped_numel`` bookkeeping for function policies) so a model wraps into the same
units it had under ``FullyShardedDataParallel``.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from torch import nn

from fsdp_ext._torch import FSDP1Policy, run_fsdp1_policy
from fsdp_ext.wrap.cost import CostModel
from fsdp_ext.wrap.tree import ModuleInfo, can_be_unit, is_indivisible, module_infos


@dataclass(frozen=True)
class GranularityPolicy:
    """DeepSpeed-style granularity wrap: one unit per fine-grained subtree.

    Walk parent-first; the first module whose granularity is at or below ``threshold``
    becomes one unit with its whole subtree; coarser modules are descended into, and a
    coarse module that cannot be split (a parameterised leaf such as a large embedding,
    an ``nn.MultiheadAttention``, an MoE block) becomes its own unit.

    ``memory_budget_bytes`` instead picks the plan with the lowest modelled step cost
    (``cost_model``, default :class:`CostModel`) whose estimated peak of unsharded
    parameters and gradients fits: units from the granularity walk, adjacent siblings
    grouped, prefetch and ``reshard_after_forward`` chosen, small units folded into the
    root (:mod:`fsdp_ext.wrap.search`). With neither, the default is
    one unit per repeated block: the outermost children of ModuleList/ModuleDict/
    Sequential containers (transformer layers) are the blocks, the threshold is the
    largest block granularity, and the blocks' ancestors are always descended into (so
    the blocks are not swallowed by a coarser ancestor). Without containers: 0, every
    indivisible module its own unit.
    """

    threshold: int | None = None
    memory_budget_bytes: int | None = None
    cost_model: CostModel | None = None

    def __post_init__(self) -> None:
        for name in ("threshold", "memory_budget_bytes"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise TypeError(f"{name} must be an int or None, got {value!r}")
        if self.threshold is not None and self.threshold < 0:
            raise ValueError(f"threshold must be >= 0 (parameters per layer), got {self.threshold}")
        if self.memory_budget_bytes is not None and self.memory_budget_bytes <= 0:
            raise ValueError(f"memory_budget_bytes must be > 0, got {self.memory_budget_bytes}")
        if self.cost_model is not None and not isinstance(self.cost_model, CostModel):
            raise TypeError(f"cost_model must be a CostModel or None, got {self.cost_model!r}")
        if self.threshold is not None and self.memory_budget_bytes is not None:
            raise ValueError(
                "give GranularityPolicy either threshold or memory_budget_bytes, not both "
                f"(got threshold={self.threshold}, memory_budget_bytes={self.memory_budget_bytes})"
            )


def granularity_units(
    root: nn.Module,
    threshold: float,
    infos: dict[nn.Module, ModuleInfo] | None = None,
    descend: frozenset[nn.Module] = frozenset(),
) -> list[nn.Module]:
    """Units below ``root`` for one threshold, in pre-order (roughly forward order).

    Modules in ``descend`` are always descended into, whatever their granularity.
    """
    infos = infos if infos is not None else module_infos(root)

    def is_unit(module: nn.Module) -> bool:
        info = infos[module]
        return (
            module not in descend
            and can_be_unit(module)
            and (info.granularity <= threshold or is_indivisible(module))
        )

    units: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        if infos[module].numel == 0:
            return
        if is_unit(module):
            units.append(module)
            return
        for child in module.children():
            visit(child)

    if infos[root].numel == 0 or is_unit(root):
        return []
    for child in root.children():
        visit(child)
    return units


def group_tied_units(root: nn.Module, units: list[nn.Module]) -> list[tuple[nn.Module, ...]]:
    """Units as groups: modules sharing a parameter (tied embeddings) become one group.

    A parameter used by two units cannot be sharded by either, so their modules are
    sharded together, ``fully_shard([a, b])``. A module outside every unit that shares
    a parameter with a unit joins that group when it holds no unit itself (a tied
    output layer); where no group can hold every user (the root itself, or a unit
    nested in another), the units concerned are dropped and the root keeps the
    parameter, as before. Groups are listed at their first member, in pre-order.
    """
    order = {m: i for i, m in enumerate(root.modules())}
    unit_set = set(units)
    # A module reached by two paths (shared) may sit in two units: follow every path.
    paths = list(root.named_modules(remove_duplicate=False))
    by_name = dict(paths)
    holders: dict[nn.Module, set[nn.Module | None]] = {}  # deepest unit on each path
    contains_unit: set[nn.Module] = set()
    for name, module in paths:
        parts = name.split(".") if name else []
        chain = [by_name[".".join(parts[:i])] for i in range(len(parts) + 1)]
        deepest = None
        for i, ancestor in enumerate(chain):
            if ancestor in unit_set:
                deepest = ancestor
                if i:
                    contains_unit.update(chain[:i])
        holders.setdefault(module, set()).add(deepest)
    owners: dict[nn.Parameter, list[nn.Module]] = {}
    for module in root.modules():
        for param in module.parameters(recurse=False):
            owners.setdefault(param, []).append(module)
    parent = {u: u for u in units}

    def find(u: nn.Module) -> nn.Module:
        while parent[u] is not u:
            u = parent[u]
        return u

    dropped: set[nn.Module] = set()
    for users in owners.values():
        groups = set().union(*(holders[m] for m in users))
        if len(groups) == 1:
            continue
        units_hit = groups - {None}
        joiners = [m for m in users if None in holders[m]]
        blocked = any(
            m is root or m in contains_unit or holders[m] != {None} for m in joiners
        ) or any(a is not b and a in set(b.modules()) for a in units_hit for b in units_hit)
        if blocked:
            dropped |= units_hit
            continue
        for m in joiners:
            parent[m] = m
        first, *rest = [find(u) for u in [*units_hit, *joiners]]
        for other in rest:
            parent[find(other)] = first
    members: dict[nn.Module, list[nn.Module]] = {}
    for module in parent:
        members.setdefault(find(module), []).append(module)
    out = []
    for group in members.values():
        if any(m in dropped or find(m) in dropped for m in group):
            continue
        out.append(tuple(sorted(group, key=order.__getitem__)))
    return sorted(out, key=lambda g: order[g[0]])


def _is_fsdp1_function_policy(policy: Callable) -> bool:
    """FSDP1 function policies take (module, recurse, nonwrapped_numel)."""
    try:
        params = inspect.signature(policy).parameters
    except (TypeError, ValueError):
        return False
    return "recurse" in params and "nonwrapped_numel" in params


def _fsdp1_function_units(root: nn.Module, policy: Callable) -> list[nn.Module]:
    """FSDP1's ``_recursive_wrap`` selection, without wrapping anything.

    A module is asked ``recurse=True`` with all its parameters; if yes, its children
    are visited first and it is then asked ``recurse=False`` with the parameters its
    wrapped children did not take. The root itself is only recursed into
    (``only_wrap_children=True``), as FSDP1 wraps it separately.
    """
    units: list[nn.Module] = []

    def visit(module: nn.Module, is_root: bool) -> int:
        nonwrapped_numel = sum(p.numel() for p in module.parameters())
        if not policy(module=module, recurse=True, nonwrapped_numel=nonwrapped_numel):
            return 0
        wrapped_numel = sum(visit(child, False) for _, child in module.named_children())
        remainder = nonwrapped_numel - wrapped_numel
        if not is_root and policy(module=module, recurse=False, nonwrapped_numel=remainder):
            units.append(module)
            return nonwrapped_numel
        return wrapped_numel

    visit(root, True)
    return units


def _preorder(root: nn.Module, selected: Iterable[nn.Module]) -> list[nn.Module]:
    chosen = set(selected)
    return [m for m in root.modules() if m in chosen and m is not root]


def select_units(root: nn.Module, policy: object) -> list[nn.Module]:
    """Modules below ``root`` that a non-granularity ``policy`` makes units, in pre-order.

    (A GranularityPolicy needs the peak estimate to resolve; :func:`plan_units` does it.)
    """
    if policy is None:
        return []
    if isinstance(policy, FSDP1Policy):
        return _preorder(root, run_fsdp1_policy(policy, root))
    if isinstance(policy, (set, frozenset, list, tuple)):
        if not policy or not all(isinstance(c, type) and issubclass(c, nn.Module) for c in policy):
            raise ValueError(
                "auto_wrap_policy given as a collection must hold nn.Module subclasses, "
                f"got {policy!r}"
            )
        classes = tuple(policy)
        return [m for m in root.modules() if m is not root and isinstance(m, classes)]
    if isinstance(policy, functools.partial) or callable(policy):
        if isinstance(policy, type):
            raise ValueError(
                f"auto_wrap_policy is a class ({policy.__name__}); pass {{{policy.__name__}}} "
                "to wrap each instance, or an instance of a policy class"
            )
        if _is_fsdp1_function_policy(policy):
            return _preorder(root, _fsdp1_function_units(root, policy))
        return [m for m in root.modules() if m is not root and bool(policy(m))]
    raise ValueError(
        "auto_wrap_policy must be a GranularityPolicy, an FSDP1 policy (ModuleWrapPolicy, "
        "CustomPolicy, functools.partial of size_based_auto_wrap_policy / "
        "transformer_auto_wrap_policy), a set of nn.Module classes, or a callable "
        f"(module) -> bool; got {type(policy).__name__}: {policy!r}"
    )
