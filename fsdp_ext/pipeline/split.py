"""Split a model into contiguous pipeline stages that keep the model's own fqns.

torchtitan's approach: a stage is the model with everything outside the stage removed.
The blocks (the children of the model's largest ``ModuleList``, ``ModuleDict`` or
``Sequential``) are cut into contiguous runs; modules registered before the blocks (the
embeddings) go with the first stage and modules registered after them (final norm,
output head) with the last. Removed top-level modules become ``None``, so the model's
forward must skip a ``None`` module (``h = self.norm(h) if self.norm is not None else h``).
Parameters held by the model itself (or by the container's other ancestors) go with the
first stage and are ``None`` elsewhere, so the forward must skip a ``None`` parameter too.
Removed blocks are dropped from the container while the kept ones keep their keys, so
``stage.state_dict()`` is a slice of ``model.state_dict()``: a checkpoint written at one
pp degree loads at any other, by fqn.

Stages share the kept modules (and their parameters) with ``model``; only the stage's
root and container objects are new.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from torch import nn

CONTAINER_TYPES = (nn.ModuleList, nn.ModuleDict, nn.Sequential)

Cost = Callable[[nn.Module], float]


class StageBlocks(nn.ModuleDict):
    """The blocks of a ``ModuleList`` that one stage keeps, under their original indices.

    A ``ModuleList`` would renumber its entries (and so change fqns); this keeps the
    keys and iterates like a list, so ``for layer in self.layers`` still works.
    """

    def __iter__(self) -> Iterator[nn.Module]:  # type: ignore[override]
        return iter(self.values())

    def __getitem__(self, key: int | str) -> nn.Module:  # type: ignore[override]
        return super().__getitem__(str(key))


@dataclass(frozen=True)
class StagePlan:
    """Which modules each stage holds, by fqn, and its cost."""

    container: str  # fqn of the blocks' container ("" when the model is the container)
    blocks: tuple[str, ...]  # the container's keys, in order
    bounds: tuple[tuple[int, int], ...]  # [start, stop) into ``blocks``, one per stage
    first: tuple[str, ...]  # fqns of the modules that go with the first stage
    last: tuple[str, ...]  # ... and with the last stage
    costs: tuple[float, ...]  # per stage, extras included
    block_costs: tuple[float, ...]

    @property
    def num_stages(self) -> int:
        return len(self.bounds)

    def block_fqns(self, stage: int) -> list[str]:
        start, stop = self.bounds[stage]
        prefix = f"{self.container}." if self.container else ""
        return [prefix + b for b in self.blocks[start:stop]]

    def __str__(self) -> str:
        total = sum(self.costs) or 1.0
        ideal = total / self.num_stages
        lines = [
            f"stage split: {self.num_stages} stages over {len(self.blocks)} blocks "
            f"of {self.container or '<root>'}",
            f"{'stage':>5}  {'blocks':<14} {'cost':>12} {'share':>7} {'vs ideal':>9}  extras",
        ]
        for s, ((start, stop), cost) in enumerate(zip(self.bounds, self.costs, strict=True)):
            extras = []
            if s == 0:
                extras += self.first
            if s == self.num_stages - 1:
                extras += self.last
            blocks = f"{self.blocks[start]}..{self.blocks[stop - 1]}"
            lines.append(
                f"{s:>5}  {blocks:<14} {cost:>12,.0f} {cost / total:>7.1%} "
                f"{cost / ideal:>8.2f}x  {', '.join(extras)}"
            )
        return "\n".join(lines)


def param_cost(module: nn.Module) -> float:
    """The default cost: parameters in the module's subtree."""
    return float(sum(p.numel() for p in module.parameters()))


def balanced_bounds(
    block_costs: list[float], num_stages: int, first_extra: float = 0.0, last_extra: float = 0.0
) -> tuple[tuple[int, int], ...]:
    """The contiguous split minimising the most expensive stage (exact, O(k n^2)).

    Stage 0 also pays ``first_extra`` and the last stage ``last_extra``. Every stage
    gets at least one block. Ties go to the split that puts more blocks early.
    """
    n = len(block_costs)
    if not 1 <= num_stages <= n:
        raise ValueError(f"num_stages must be in [1, {n}] (one block at least per stage)")
    prefix = [0.0]
    for c in block_costs:
        prefix.append(prefix[-1] + c)

    def stage_cost(k: int, i: int, j: int) -> float:
        cost = prefix[j] - prefix[i]
        if k == 0:
            cost += first_extra
        if k == num_stages - 1:
            cost += last_extra
        return cost

    inf = float("inf")
    # best[k][j]: the smallest max cost of stages 0..k covering blocks [0, j).
    best = [[inf] * (n + 1) for _ in range(num_stages)]
    cut = [[0] * (n + 1) for _ in range(num_stages)]
    for j in range(1, n + 1):
        best[0][j] = stage_cost(0, 0, j)
    for k in range(1, num_stages):
        for j in range(k + 1, n + 1):
            for i in range(j - 1, k - 1, -1):
                value = max(best[k - 1][i], stage_cost(k, i, j))
                if value < best[k][j]:
                    best[k][j], cut[k][j] = value, i
    bounds = []
    j = n
    for k in range(num_stages - 1, -1, -1):
        i = cut[k][j] if k else 0
        bounds.append((i, j))
        j = i
    return tuple(reversed(bounds))


def find_blocks(model: nn.Module) -> tuple[str, nn.Module]:
    """The outermost container holding the most parameters (the model's blocks)."""
    if isinstance(model, CONTAINER_TYPES):
        return "", model
    candidates = [
        (fqn, m)
        for fqn, m in model.named_modules()
        if fqn and isinstance(m, CONTAINER_TYPES) and len(m) > 0
    ]
    if not candidates:
        raise ValueError(
            "split_stages needs the model's blocks in an nn.ModuleList, nn.ModuleDict or "
            f"nn.Sequential; {type(model).__name__} has none"
        )
    most = max(param_cost(m) for _, m in candidates)
    return next((fqn, m) for fqn, m in candidates if param_cost(m) == most)


def _extras(model: nn.Module, container_fqn: str) -> tuple[list[str], list[str]]:
    """Modules registered before / after the path to the container, at every level."""
    first, last = [], []
    module, prefix = model, ""
    for part in container_fqn.split(".") if container_fqn else []:
        names = _child_names(module)
        at = names.index(part)
        first += [prefix + n for n in names[:at]]
        last += [prefix + n for n in names[at + 1 :]]
        module, prefix = module.get_submodule(part), f"{prefix}{part}."
    return first, last


def _child_names(module: nn.Module) -> list[str]:
    """Names of ``module``'s children in registration order (None entries left out)."""
    return [name for name, _ in module.named_children()]


def plan_stages(model: nn.Module, num_stages: int, *, cost: str | Cost = "params") -> StagePlan:
    """Decide the split without building anything (works on a meta-device model)."""
    if cost == "params":
        cost_fn: Cost = param_cost
    elif callable(cost):
        cost_fn = cost
    else:
        raise ValueError(f"cost must be 'params' or a callable (module) -> float, got {cost!r}")
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"num_stages must be an int >= 1, got {num_stages!r}")
    container_fqn, container = find_blocks(model)
    blocks = _child_names(container)
    if num_stages > len(blocks):
        raise ValueError(
            f"num_stages={num_stages} exceeds the {len(blocks)} blocks of "
            f"{container_fqn or type(model).__name__}; every stage needs one block at least"
        )
    _check_no_shared_params(model)
    first, last = _extras(model, container_fqn)
    block_costs = [float(cost_fn(container.get_submodule(b))) for b in blocks]
    first_extra = sum(float(cost_fn(model.get_submodule(f))) for f in first)
    first_extra += sum(float(p.numel()) for p in _root_params(model, container_fqn))
    last_extra = sum(float(cost_fn(model.get_submodule(f))) for f in last)
    bounds = balanced_bounds(block_costs, num_stages, first_extra, last_extra)
    costs = []
    for s, (i, j) in enumerate(bounds):
        c = sum(block_costs[i:j])
        c += first_extra if s == 0 else 0.0
        c += last_extra if s == num_stages - 1 else 0.0
        costs.append(c)
    return StagePlan(
        container_fqn,
        tuple(blocks),
        bounds,
        tuple(first),
        tuple(last),
        tuple(costs),
        tuple(block_costs),
    )


def _path_modules(model: nn.Module, container_fqn: str) -> list[nn.Module]:
    """The model and the container's other ancestors (copied into every stage)."""
    modules, module = [model], model
    for part in container_fqn.split(".")[:-1] if container_fqn else []:
        module = module.get_submodule(part)
        modules.append(module)
    return modules


def _root_params(model: nn.Module, container_fqn: str) -> list[nn.Parameter]:
    """Parameters held directly by the modules on the path to the container: they go with
    the first stage, like the modules registered before the blocks."""
    return [
        p
        for module in _path_modules(model, container_fqn)
        for _, p in module.named_parameters(recurse=False)
    ]


def _check_no_shared_params(model: nn.Module) -> None:
    seen: dict[int, str] = {}
    for fqn, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            raise ValueError(
                f"parameters {seen[id(p)]!r} and {fqn!r} are the same tensor (tied weights); "
                "split_stages cannot put one tensor in two stages: untie them first"
            )
        seen[id(p)] = fqn


def build_stage(model: nn.Module, plan: StagePlan, stage: int) -> nn.Module:
    """Stage ``stage`` of ``plan``: ``model`` without the other stages' modules."""
    if not 0 <= stage < plan.num_stages:
        raise ValueError(f"stage must be in [0, {plan.num_stages}), got {stage}")
    keep_blocks = set(plan.blocks[slice(*plan.bounds[stage])])
    dropped = set()
    if stage != 0:
        dropped |= set(plan.first)
    if stage != plan.num_stages - 1:
        dropped |= set(plan.last)
    container = model.get_submodule(plan.container) if plan.container else model
    # deepcopy copies only the skeleton: kept modules map to themselves (shared), and
    # dropped ones to None; the container is rebuilt below.
    memo: dict[int, object] = {}
    for fqn, module in model.named_modules():
        if module is container or not fqn or _on_path(fqn, plan.container):
            continue
        memo[id(module)] = None if fqn in dropped else module
    for key, block in container.named_children():
        memo[id(block)] = block if key in keep_blocks else None
    for p in model.parameters():
        memo[id(p)] = p
    for b in model.buffers():
        memo[id(b)] = b
    memo[id(container)] = container  # replaced below
    stage_module = copy.deepcopy(model, memo)
    if stage != 0:  # root parameters went with the first stage; the forward skips a None
        for module in _path_modules(stage_module, plan.container):
            for name, _ in list(module.named_parameters(recurse=False)):
                module.register_parameter(name, None)
    kept = OrderedDict((k, m) for k, m in container.named_children() if k in keep_blocks)
    if not plan.container:
        return nn.Sequential(kept)
    new_container: nn.Module
    if isinstance(container, nn.ModuleList):
        new_container = StageBlocks(kept)
    elif isinstance(container, nn.ModuleDict):
        new_container = nn.ModuleDict(kept)
    else:
        new_container = nn.Sequential(kept)
    parent_fqn, _, name = plan.container.rpartition(".")
    parent = stage_module.get_submodule(parent_fqn) if parent_fqn else stage_module
    parent.register_module(name, new_container)
    return stage_module


def _on_path(fqn: str, container_fqn: str) -> bool:
    """``fqn`` is a strict ancestor of the container (copied, never shared)."""
    return bool(container_fqn) and container_fqn.startswith(fqn + ".")


def split_stages(
    model: nn.Module, num_stages: int, *, cost: str | Cost = "params", verbose: bool = True
) -> list[nn.Module]:
    """Split ``model`` into ``num_stages`` contiguous, cost-balanced stage modules.

    ``cost``: ``"params"`` (parameter count) or a callable ``(module) -> float`` applied
    to each block and to each extra module (embeddings, norm, head). The split minimises
    the most expensive stage. Prints the balance table unless ``verbose=False``.
    """
    plan = plan_stages(model, num_stages, cost=cost)
    if verbose:
        print(plan)
    return [build_stage(model, plan, s) for s in range(plan.num_stages)]
