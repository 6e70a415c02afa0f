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

import torch
from torch import nn
from torch.distributed.fsdp.wrap import _Policy

from fsdp_ext.wrap.tree import ModuleInfo, is_container, is_indivisible, module_infos


@dataclass(frozen=True)
class GranularityPolicy:
    """DeepSpeed-style granularity wrap: one unit per fine-grained subtree.

    Walk parent-first; the first module whose granularity is at or below ``threshold``
    becomes one unit with its whole subtree; coarser modules are descended into, and a
    coarse module that cannot be split (a parameterised leaf such as a large embedding,
    an ``nn.MultiheadAttention``, an MoE block) becomes its own unit.

    ``memory_budget_bytes`` instead picks the coarsest threshold whose estimated peak
    unsharded bytes (see :mod:`fsdp_ext.wrap.plan`) fit. With neither, the default is
    one unit per repeated block: the outermost children of ModuleList/ModuleDict/
    Sequential containers (transformer layers) are the blocks, the threshold is the
    largest block granularity, and the blocks' ancestors are always descended into (so
    the blocks are not swallowed by a coarser ancestor). Without containers: 0, every
    indivisible module its own unit.
    """

    threshold: int | None = None
    memory_budget_bytes: int | None = None

    def __post_init__(self) -> None:
        for name in ("threshold", "memory_budget_bytes"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise TypeError(f"{name} must be an int or None, got {value!r}")
        if self.threshold is not None and self.threshold < 0:
            raise ValueError(f"threshold must be >= 0 (parameters per layer), got {self.threshold}")
        if self.memory_budget_bytes is not None and self.memory_budget_bytes <= 0:
            raise ValueError(f"memory_budget_bytes must be > 0, got {self.memory_budget_bytes}")
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
            and not is_container(module)
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
    return _drop_units_splitting_shared_params(root, units)


def _drop_units_splitting_shared_params(root: nn.Module, units: list[nn.Module]) -> list[nn.Module]:
    """A parameter used by two units cannot be sharded by either (tied embeddings)."""
    owners: dict[torch.nn.Parameter, set[nn.Module]] = {}
    for module in root.modules():
        for param in module.parameters(recurse=False):
            owners.setdefault(param, set()).add(module)
    kept = []
    for unit in units:
        subtree = set(unit.modules())
        if all(owners[p] <= subtree for p in unit.parameters()):
            kept.append(unit)
    return kept


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
    if isinstance(policy, _Policy):
        return _preorder(root, policy._run_policy(root, set(), {}))
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
