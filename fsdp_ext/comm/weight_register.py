"""One call to put the quantised parameter all-gather (qwZ) on every FSDP unit of a model."""

from __future__ import annotations

import torch
from torch.distributed.fsdp import FSDPModule

from fsdp_ext._torch import (
    DefaultAllGather,
    fsdp_state_id,
    group_device,
    param_groups,
    shard_process_group,
)
from fsdp_ext.comm.codec import WireChoice
from fsdp_ext.comm.weight_all_gather import QuantizedWeightAllGather, WeightGatherStats
from fsdp_ext.comm.weight_config import WeightQuantConfig

__all__ = ["WeightGatherHandle", "register_weight_all_gather"]


class WeightGatherHandle:
    """Returned by :func:`register_weight_all_gather`: byte counts, and ``remove()``.

    qwZ keeps no state between steps (the same shard always gives the same bytes), so
    there is nothing to checkpoint; a resumed run quantises its loaded weights as the
    straight run quantised the same weights.
    """

    def __init__(self, comms: dict[str, tuple[FSDPModule, QuantizedWeightAllGather]]):
        self._comms = comms
        self._removed = False

    @property
    def units(self) -> list[str]:
        return list(self._comms)

    @property
    def stats(self) -> WeightGatherStats:
        total = WeightGatherStats()
        for _, comm in self._comms.values():
            total.add(comm.stats)
        return total

    @property
    def all_gathers(self) -> dict[str, QuantizedWeightAllGather]:
        """The all-gather installed on each unit, by the names of :attr:`units`."""
        return {fqn: comm for fqn, (_, comm) in self._comms.items()}

    @property
    def wire_choices(self) -> dict[str, WireChoice]:
        """Per unit: its gather's payload and plain bytes per rank, and whether it is
        encoded (units whose payload would be larger go plain)."""
        return {fqn: comm.wire for fqn, (_, comm) in self._comms.items()}

    def reset_stats(self) -> None:
        for _, comm in self._comms.values():
            comm.stats = WeightGatherStats()

    def remove(self) -> None:
        """Give every unit back the stock all-gather."""
        if self._removed:
            return
        for module, _ in self._comms.values():
            module.set_custom_all_gather(None if DefaultAllGather is None else DefaultAllGather())
        self._removed = True


def register_weight_all_gather(
    model: torch.nn.Module, config: WeightQuantConfig | None = None
) -> WeightGatherHandle:
    """Install a :class:`QuantizedWeightAllGather` on every FSDP unit of ``model``.

    Call it on every rank, after ``fully_shard`` (any wrap, mixed precision, experts on
    their own mesh, ``reshard_after_forward`` an int for hpZ). A unit with several param
    groups (per-parameter meshes through ``shard_placement_fn``) is refused, since FSDP2
    takes one all-gather comm per unit; so is a group size the CUDA kernels lack.
    """
    config = config if config is not None else WeightQuantConfig()
    if not isinstance(config, WeightQuantConfig):
        raise TypeError(f"config must be a WeightQuantConfig, got {type(config).__name__}")
    comms: dict[str, tuple[FSDPModule, QuantizedWeightAllGather]] = {}
    names: dict[int, list[str]] = {}
    for fqn, module in model.named_modules():
        if not isinstance(module, FSDPModule):
            continue
        state = fsdp_state_id(module)
        if state in names:  # one unit of several modules: fully_shard([a, b])
            names[state].append(fqn or "<root>")
            continue
        names[state] = [fqn or "<root>"]
        groups = param_groups(module)
        if len(groups) > 1:
            raise ValueError(
                f"unit {fqn or '<root>'} has several param groups (per-parameter meshes); "
                "FSDP2 takes one all-gather comm per unit, so give each mesh its own "
                "fully_shard call to use WeightQuantConfig"
            )
        if not groups or shard_process_group(groups[0]) is None:
            continue  # no parameter, or replicate-only (nothing is gathered)
        group = groups[0]
        comm = QuantizedWeightAllGather(config, group, fqn or "<root>")
        device = group_device(group)
        try:
            comm.codec.check_device(device)
        except ValueError as exc:
            raise ValueError(f"unit {fqn or '<root>'} gathers on {device}: {exc}") from exc
        comms[state] = (module, comm)
    if not comms:
        raise ValueError(
            "model has no FSDP unit to gather: call fully_shard before register_weight_all_gather"
        )
    by_name = {}
    for state, (module, comm) in comms.items():
        comm.fqn = "+".join(names[state])
        module.set_custom_all_gather(comm)
        by_name[comm.fqn] = (module, comm)
    return WeightGatherHandle(by_name)
