"""One FSDP unit as LoCo sees it: its trainable parameters, their layout, and which of them
got a gradient since the unit's last reduction.

FSDP2 gives the comm only the flat input, not the parameters in it, so each unsharded
parameter gets a post-accumulate-grad hook that marks it present. The hooks are attached
after FSDP's own pre-forward (which creates the unsharded parameters on first use).
Reads FSDP2's per-unit state (``FSDPParamGroup``) through the accessors of ``fsdp_ext._torch``.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from fsdp_ext._torch import (
    FSDPParamGroup,
    fsdp_units,
    group_device,
    group_modules,
    padded_shard_numel,
    param_group,
    param_mp_policy,
    sharded_param,
    trainable_fsdp_params,
    unsharded_param,
)
from fsdp_ext.comm.layout import ParamLayout, Present

SUPPORTED_REDUCE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def comm_units(
    model: nn.Module, feature: str
) -> list[tuple[str, nn.Module, FSDPParamGroup | None]]:
    """(name, module, param group or None) of each FSDP unit of ``model``, in
    :func:`fsdp_ext._torch.fsdp_units` order; a unit of several modules is named by their
    names joined with "+" (the root's is "<root>"). A unit with several param groups
    (per-parameter meshes through ``shard_placement_fn``) is refused: FSDP2 takes one comm
    per unit, which ``feature`` needs."""
    out = []
    for unit in fsdp_units(model):
        name = "+".join(n or "<root>" for n in unit.names)
        if len(unit.groups) > 1:
            raise ValueError(
                f"unit {name} has several param groups (per-parameter meshes); FSDP2 takes one "
                f"comm per unit, so give each mesh its own fully_shard call to use {feature}"
            )
        out.append((name, unit.module, unit.groups[0] if unit.groups else None))
    return out


def reduce_dtype_of(group: FSDPParamGroup) -> torch.dtype:
    """The dtype FSDP reduces this unit's gradients in (its mixed-precision policy)."""
    trainable = trainable_fsdp_params(group)
    if not trainable:
        return torch.float32
    mp = param_mp_policy(group, trainable[0])  # FSDP requires one reduce dtype per group
    return mp.reduce_dtype or mp.param_dtype or sharded_param(trainable[0]).dtype


class UnitBinding:
    """The layout of one unit's trainable parameters and a record of which got gradients.

    Frozen parameters are never reduced by FSDP, so they are not part of the layout.
    """

    def __init__(self, group: FSDPParamGroup, names: dict[int, str], fqn: str):
        self.group = group
        self.fqn = fqn
        self._fsdp_params = trainable_fsdp_params(group)
        self.layout = ParamLayout(
            [names.get(id(sharded_param(p)), f"param{i}") for i, p in enumerate(self._fsdp_params)],
            [padded_shard_numel(p) for p in self._fsdp_params],
        )
        self.device = group_device(group)
        self._seen = [False] * len(self._fsdp_params)
        self._stale = False
        self._hooked: dict[int, nn.Parameter] = {}
        self._handles: list = []
        self._complete = False
        for module in group_modules(group):
            self._handles.append(module.register_forward_pre_hook(self._attach_hook))
        self.attach()

    @classmethod
    def for_module(cls, module: FSDPModule, names: dict[int, str] | None = None, fqn: str = ""):
        group = param_group(module)
        if group is None:
            raise ValueError(f"unit {fqn or '<root>'} manages no parameter")
        if names is None:
            names = {id(p): n for n, p in module.named_parameters()}
        return cls(group, names, fqn)

    def _attach_hook(self, *_: object) -> None:
        if not self._complete:
            self.attach()

    def attach(self) -> None:
        """Hook every unsharded parameter that exists by now (FSDP creates them lazily)."""
        for i, fsdp_param in enumerate(self._fsdp_params):
            unsharded = unsharded_param(fsdp_param)
            if unsharded is None or self._hooked.get(i) is unsharded:
                continue
            self._hooked[i] = unsharded
            self._handles.append(
                unsharded.register_post_accumulate_grad_hook(lambda _, i=i: self._mark(i))
            )
        self._complete = len(self._hooked) == len(self._fsdp_params)

    def _mark(self, index: int) -> None:
        if self._stale:  # first gradient after a reduction: a new accumulation window
            self._seen = [False] * len(self._seen)
            self._stale = False
        self._seen[index] = True

    def present(self, shard: int) -> Present:
        """The parameters in a reduction of ``shard`` elements per rank (checked against it).

        Every read marks the window closed: the next gradient starts a new one. The
        reduce-scatter and the all-reduce hook of the same reduction read the same set.
        """
        if getattr(self.group, "reduce_scatter_unused_params", False):
            present = tuple(i for i in range(len(self._seen)) if i in self._hooked)
        else:
            present = tuple(i for i, seen in enumerate(self._seen) if seen)
        self._stale = True
        if self.layout.width_of(present) == shard:
            return present
        if self.layout.width == shard:  # every parameter (e.g. hooks attached late)
            return self.layout.all_present
        raise RuntimeError(
            f"LoCo on unit {self.fqn or '<root>'}: a reduction of {shard} elements per rank "
            f"matches neither the parameters that got gradients "
            f"({', '.join(self.layout.names_of(present)) or 'none'}; "
            f"{self.layout.width_of(present)} elements) nor the whole unit "
            f"({self.layout.width}); was requires_grad changed after fsdp_ext.comm.enable?"
        )

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._hooked.clear()
        self._complete = True
