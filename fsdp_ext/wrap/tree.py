"""Module-tree facts the wrap planner needs: subtree sizes, DeepSpeed granularity, leaves.

Granularity follows DeepSpeed ZeRO-3 (``stage3_module_granularity_threshold``): the
parameters in a module's subtree divided by the parameterised, non-container modules in
that subtree (the module itself included). Containers are not counted and modules
without parameters are ignored, so the number says how many parameters each real layer
in the subtree holds on average. Small means fine-grained: many modules, each too small
to be worth its own hook, all-gather and reduce-scatter.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

CONTAINER_TYPES: tuple[type[nn.Module], ...] = (nn.ModuleList, nn.Sequential, nn.ModuleDict)
# Parameter holders with no forward: FSDP2 gathers a unit in its forward pre-hook, so
# such a module as a unit would never be gathered; its parameters belong to its parent.
NO_FORWARD_TYPES: tuple[type[nn.Module], ...] = (
    nn.ModuleList,
    nn.ModuleDict,
    nn.ParameterList,
    nn.ParameterDict,
)
# Modules whose forward reads a child's weight directly, so the child can never be a
# unit of its own (FSDP1 keeps the same set in size_based_auto_wrap_policy).
FORCE_LEAF_TYPES: tuple[type[nn.Module], ...] = (nn.MultiheadAttention,)
EXPERT_NAME = "expert"
# Set to True on an experts container whose MoE calls every expert on every step (idle
# ones on an empty slice): then per-expert units are safe and fully_shard allows them.
EXPERTS_ALWAYS_RUN_ATTR = "experts_always_run"


@dataclass
class ModuleInfo:
    """Sizes of one module's subtree; ``granularity`` is None for containers."""

    fqn: str
    module: nn.Module
    numel: int
    layers: int
    granularity: int | None
    is_leaf: bool


def is_container(module: nn.Module) -> bool:
    # Exact types: a subclass of Sequential with its own forward is still a container
    # in DeepSpeed's sense (it only chains children), so isinstance is right here.
    return isinstance(module, CONTAINER_TYPES)


def can_be_unit(module: nn.Module) -> bool:
    """Not a container and has a forward of its own (FSDP2 hooks forward)."""
    return not is_container(module) and not isinstance(module, NO_FORWARD_TYPES)


def has_expert_child(module: nn.Module) -> bool:
    """An MoE block: a router and a child holding the routed experts (see below).

    Routing calls only the experts that received tokens, and on each rank a different
    set, so nothing under the experts child may be a unit of its own (its all-gather would
    run on some ranks only), and the unit holding the block must reduce-scatter idle
    experts' (zero) gradients too.
    """
    return any(is_routed_experts(module, name, child) for name, child in module.named_children())


def is_routed_experts(parent: nn.Module, name: str, child: nn.Module) -> bool:
    """``parent.<name>`` holds routed experts, by structure or, failing that, by name.

    Structure: ``child`` holds ``E >= 2`` experts (a container of ``E`` children with the
    same type and parameter shapes, or a module whose own parameters are all stacked
    ``[E, ...]``), and a sibling router holds only ``[E, ...]`` parameters, among them an
    ``[E, dim]`` weight (a ``Linear(dim, E)`` gate). Name: the child is called like
    ``experts`` and holds parameters, as in HF (``mlp.experts``), torchtitan
    (``moe.experts``) and DeepSpeed (``deepspeed_moe.experts``).
    """
    if not any(True for _ in child.parameters()):
        return False
    if EXPERT_NAME in name.lower():
        return True
    num_experts = _expert_count(child)
    if num_experts is None:
        return False
    return any(other is not child and _is_router(other, num_experts) for other in parent.children())


def _expert_count(module: nn.Module) -> int | None:
    """E if ``module`` holds E >= 2 alike experts, as a container or as stacked tensors."""
    if is_container(module):
        experts = [c for c in module.children() if any(True for _ in c.parameters())]
        shapes = [[p.shape for p in e.parameters()] for e in experts]
        alike = all(
            type(e) is type(experts[0]) and s == shapes[0]
            for e, s in zip(experts, shapes, strict=True)
        )
        return len(experts) if len(experts) >= 2 and alike else None
    params = list(module.parameters())
    if any(True for _ in module.children()) or any(p.dim() < 2 for p in params):
        return None
    leading = {p.shape[0] for p in params}
    stacked = len(leading) == 1 and any(p.dim() >= 3 for p in params)
    return leading.pop() if stacked and min(leading) >= 2 else None


def _is_router(module: nn.Module, num_experts: int) -> bool:
    """Only ``[num_experts, ...]`` parameters, and an ``[num_experts, dim]`` weight."""
    params = list(module.parameters())
    return (
        bool(params)
        and all(p.dim() >= 1 and p.shape[0] == num_experts for p in params)
        and any(p.dim() == 2 for p in params)
    )


def is_indivisible(module: nn.Module) -> bool:
    """Never split: no child that could be a unit and holds parameters (a
    ``ParameterList`` child cannot), a force-leaf type, or an MoE block."""
    if isinstance(module, FORCE_LEAF_TYPES):
        return True
    if not any(
        can_be_unit(child) or is_container(child)
        for child in module.children()
        if any(True for _ in child.parameters())
    ):
        return True
    return has_expert_child(module)


def module_infos(root: nn.Module) -> dict[nn.Module, ModuleInfo]:
    """Granularity of every module under ``root`` (shared modules counted once)."""
    infos: dict[nn.Module, ModuleInfo] = {}

    def visit(module: nn.Module, fqn: str) -> tuple[set[torch.nn.Parameter], int]:
        params: set[torch.nn.Parameter] = set(module.parameters(recurse=False))
        layers = 0
        children = list(module.named_children())
        for name, child in children:
            if child in infos:
                continue
            child_params, child_layers = visit(child, f"{fqn}.{name}" if fqn else name)
            params |= child_params
            layers += child_layers
        numel = sum(p.numel() for p in params)
        container = is_container(module)
        if numel > 0 and not container:
            layers += 1
        granularity = numel // layers if numel > 0 and not container else None
        infos[module] = ModuleInfo(fqn, module, numel, layers, granularity, not children)
        return params, layers

    visit(root, "")
    return infos


def repeated_blocks(root: nn.Module) -> tuple[list[nn.Module], frozenset[nn.Module]]:
    """The outermost children of containers (e.g. transformer layers) and their ancestors.

    Indivisible modules are not looked into (an MoE block's experts are not blocks). A
    container inside a container is looked into (it has no forward, so it cannot be a
    unit: its children are the blocks); a child with no forward (``ParameterList``) is no
    block, and its parameters stay with the unit above.
    """
    blocks: list[nn.Module] = []
    ancestors: set[nn.Module] = set()

    def visit(module: nn.Module, path: list[nn.Module]) -> None:
        if module is not root and is_indivisible(module):
            return
        if is_container(module):
            children = [c for c in module.children() if any(True for _ in c.parameters())]
            if children:
                ancestors.update(path, [module])
                for child in children:
                    if is_container(child):
                        visit(child, [*path, module])
                    elif can_be_unit(child):
                        blocks.append(child)
                return
        for child in module.children():
            visit(child, [*path, module])

    visit(root, [])
    return blocks, frozenset(ancestors)
