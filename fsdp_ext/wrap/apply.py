"""``shard_by_policy``: torch's ``fully_shard`` on each unit an ``auto_wrap_policy`` picks,
bottom-up, then on the root.

The plan is checked before anything is sharded, so a wrap FSDP2 cannot run (a unit
without a forward, a unit inside ``nn.MultiheadAttention``, a unit per routed expert)
fails here with a ValueError instead of later with a DTensor error or a hang.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, OffloadPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.fsdp.wrap import CustomPolicy

from fsdp_ext._torch import run_fsdp1_policy
from fsdp_ext.wrap.node_reshard import resolve_reshard_after_forward
from fsdp_ext.wrap.plan import plan_units
from fsdp_ext.wrap.tree import (
    EXPERTS_ALWAYS_RUN_ATTR,
    FORCE_LEAF_TYPES,
    NO_FORWARD_TYPES,
    has_expert_child,
    is_container,
    is_routed_experts,
)
from fsdp_ext.wrap.units import WrapPlan

# Torch versions before ``set_reduce_scatter_unused_params`` get the autograd fallback.
NATIVE_UNUSED_PARAM_REDUCE_SCATTER = hasattr(FSDPModule, "set_reduce_scatter_unused_params")


def _check_units(root: nn.Module, units: list[nn.Module]) -> None:
    names = {m: n for n, m in root.named_modules()}
    for unit in units:
        fqn = names[unit]
        if isinstance(unit, NO_FORWARD_TYPES):
            raise ValueError(
                f"auto_wrap_policy selected {fqn!r}, a {type(unit).__name__}: it has no "
                "forward, so FSDP2 would never gather its parameters; select its children"
            )
        parent = root
        for path, ancestor in _ancestors(root, fqn):
            if isinstance(ancestor, FORCE_LEAF_TYPES):
                raise ValueError(
                    f"auto_wrap_policy selected {fqn!r} inside {type(ancestor).__name__} "
                    f"{path!r}, whose forward reads its children's weights directly (FSDP2 "
                    "fails with mixed Tensor/DTensor); wrap the whole module instead"
                )
            if (
                is_container(ancestor)
                and is_routed_experts(parent, path.rsplit(".", 1)[-1], ancestor)
                and not getattr(ancestor, EXPERTS_ALWAYS_RUN_ATTR, False)
            ):
                raise ValueError(
                    f"auto_wrap_policy selected {fqn!r}, inside the routed experts "
                    f"{path!r}: an expert that gets no tokens on one rank skips its forward "
                    "there, so its all-gather and reduce-scatter run on some ranks only and "
                    "the job hangs. Wrap the MoE block as one unit (GranularityPolicy does), "
                    "or, if every expert runs on every rank, set "
                    f"{path}.{EXPERTS_ALWAYS_RUN_ATTR} = True"
                )
            parent = ancestor


def _ancestors(root: nn.Module, fqn: str) -> list[tuple[str, nn.Module]]:
    """(path, module) for every module strictly between ``root`` and ``fqn``."""
    parts = fqn.split(".")
    out = []
    module = root
    for i, part in enumerate(parts[:-1]):
        module = getattr(module, part)
        out.append((".".join(parts[: i + 1]), module))
    return out


def _params_outside_nested_units(block: nn.Module) -> list[tuple[nn.Module, str]]:
    """(module, name) of ``block``'s parameters that no FSDP unit inside it manages.

    Names, not tensors: FSDP2 swaps the registered parameters between sharded and
    unsharded. A nested unit's parameters are sharded again when the block's forward ends,
    and the nested unit reduce-scatters them itself.
    """
    owned, stack = [], [block]
    while stack:
        module = stack.pop()
        if isinstance(module, FSDPModule):
            continue
        owned += [(module, name) for name, _ in module.named_parameters(recurse=False)]
        stack += list(module.children())
    return owned


def _tie_params_to_output(block: nn.Module) -> None:
    """Add ``0 * sum(params)`` to the output so every parameter gets a (zero) gradient."""
    owned = _params_outside_nested_units(block)

    def hook(mod: nn.Module, args: Any, output: Any) -> Any:
        params = [p for p in (getattr(m, n) for m, n in owned) if p.requires_grad]
        if not torch.is_grad_enabled() or not params:
            return output
        zero = torch.stack([p.sum() for p in params]).sum() * 0
        if isinstance(output, torch.Tensor):
            return output + zero.to(output.dtype)
        if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
            return (output[0] + zero.to(output[0].dtype), *output[1:])
        raise TypeError(
            f"{type(mod).__name__} returns {type(output).__name__}; zero gradients for idle "
            "experts need it to return a Tensor (or a tuple starting with one)"
        )

    block.register_forward_hook(hook)


def check_wrap(
    module: nn.Module,
    auto_wrap_policy: object = None,
    *,
    mp_policy: object | None = None,
    reshard_after_forward: bool | int | str | None = None,
    world_size: int | None = None,
) -> WrapPlan:
    """The plan :func:`shard_by_policy` would apply, checked, with nothing sharded.

    Raises ``ValueError`` for a wrap FSDP2 cannot run. Callers that shard in several
    steps (``shard_moe_model``: experts first, then the rest) call it before the first.
    """
    plan = plan_units(
        module,
        auto_wrap_policy,
        mp_policy=mp_policy,
        reshard_after_forward=reshard_after_forward,
        world_size=world_size,
    )
    _check_units(module, [m for group in plan.modules for m in group])
    return plan


def shard_by_policy(
    module: nn.Module,
    *,
    auto_wrap_policy: object = None,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int | str | None = None,
    shard_placement_fn: Callable[[nn.Parameter], Any] | None = None,
    mp_policy: MixedPrecisionPolicy | None = None,
    offload_policy: OffloadPolicy | None = None,
    ignored_params: set[nn.Parameter] | None = None,
    dp_mesh_dims: Any = None,
) -> nn.Module:
    """Apply torch's ``fully_shard`` to each unit ``auto_wrap_policy`` selects, then the root.

    ``auto_wrap_policy``: a :class:`GranularityPolicy`; an FSDP1 policy
    (``ModuleWrapPolicy``, ``CustomPolicy``, ``functools.partial`` of
    ``size_based_auto_wrap_policy`` / ``transformer_auto_wrap_policy``), which makes the
    units FSDP1 would; a set of module classes; a callable ``(module) -> bool``; or None
    (the root alone, as torch's fully_shard). A ``CustomPolicy`` returning a dict adds
    those fully_shard kwargs for that module.

    The other keywords are torch's ``fully_shard``'s and go to every call: ``mesh``,
    ``reshard_after_forward`` (the plan may choose it per unit under a memory budget;
    ``"node"`` keeps a node-local secondary shard, ZeRO++'s hpZ: :mod:`.node_reshard`),
    ``shard_placement_fn``, ``mp_policy``, ``offload_policy``, ``ignored_params`` and
    ``dp_mesh_dims`` (in the torch versions that have it: 2.13 does). One left at None is
    not passed, so torch's own default applies.

    Units holding an MoE block reduce-scatter every parameter, with zeros for experts
    that got no tokens on a rank: FSDP2 otherwise skips gradient-less parameters, and
    ranks whose routing differs would send reduce-scatters of different lengths.
    """
    if reshard_after_forward is not None:
        world = mesh.size() if mesh is not None else dist.get_world_size()
        reshard_after_forward = resolve_reshard_after_forward(reshard_after_forward, mesh, world)
    given = {
        "mesh": mesh,
        "reshard_after_forward": reshard_after_forward,
        "shard_placement_fn": shard_placement_fn,
        "mp_policy": mp_policy,
        "offload_policy": offload_policy,
        "ignored_params": ignored_params,
        "dp_mesh_dims": dp_mesh_dims,
    }
    kwargs = {name: value for name, value in given.items() if value is not None}
    plan = check_wrap(
        module,
        auto_wrap_policy,
        mp_policy=mp_policy,
        reshard_after_forward=reshard_after_forward,
        world_size=None if mesh is None else mesh.shape[-1],
    )
    overrides: dict[nn.Module, dict[str, Any]] = {}
    if isinstance(auto_wrap_policy, CustomPolicy):
        overrides = run_fsdp1_policy(auto_wrap_policy, module)
        overrides.pop(module, None)  # FSDP1 wraps the root with the caller's kwargs only
    tied: set[nn.Module] = set()
    steps = [*reversed(list(zip(plan.modules, plan.reshard_after_forward, strict=True)))]
    for group, reshard in [*steps, ((module,), reshard_after_forward)]:
        head = group[0]
        if head is not module and isinstance(head, FSDPModule):
            continue  # sharded already, by the caller (e.g. experts on their own mesh)
        moe_blocks = [m for member in group for m in member.modules() if has_expert_child(m)]
        if moe_blocks and not NATIVE_UNUSED_PARAM_REDUCE_SCATTER:
            # Registered before fully_shard so it runs before FSDP resharding the unit.
            for block in moe_blocks:
                if block not in tied:
                    _tie_params_to_output(block)
                    tied.add(block)
        unit_kwargs = {**kwargs, **overrides.get(head, {})}
        if reshard is not None:
            unit_kwargs["reshard_after_forward"] = reshard
        torch_fully_shard(head if len(group) == 1 else list(group), **unit_kwargs)
        if moe_blocks and NATIVE_UNUSED_PARAM_REDUCE_SCATTER:
            head.set_reduce_scatter_unused_params(True, recurse=False)
    _apply_prefetch(module, plan)
    return module


def _apply_prefetch(root: nn.Module, plan: WrapPlan) -> None:
    """Forward/backward prefetch as planned (FSDP2's default is 0 forward, 1 backward).

    No backward prefetch is set as each unit prefetching only itself: an empty list
    would mean FSDP2's default, and a unit is gathered already when its own prefetch runs.
    """
    units = [root, *(group[0] for group in plan.modules)]
    if plan.backward_prefetch == 0:
        for unit in units:
            unit.set_modules_to_backward_prefetch([unit])
    if plan.forward_prefetch > 0:
        order = [root, *(group[0] for group in plan.modules)]
        for i, unit in enumerate(order):
            ahead = order[i + 1 : i + 1 + plan.forward_prefetch]
            if ahead:
                unit.set_modules_to_forward_prefetch(ahead)
