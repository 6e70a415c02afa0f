"""One call to put the quantised parameter all-gather (qwZ) on every FSDP unit of a model."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch
from torch.distributed.fsdp import FSDPModule

from fsdp_ext._torch import (
    DefaultAllGather,
    forward_prefetch_targets,
    group_device,
    group_unshard_async_op,
    set_group_unshard_async_op,
    shard_process_group,
)
from fsdp_ext.comm.codec import Codec, WireChoice
from fsdp_ext.comm.registry import make_codec
from fsdp_ext.comm.unit import comm_units
from fsdp_ext.comm.weight_all_gather import QuantizedWeightAllGather, WeightGatherStats
from fsdp_ext.comm.weight_config import WeightQuantConfig

__all__ = ["WeightGatherHandle", "register_weight_all_gather"]


class WeightGatherHandle:
    """Returned by :func:`register_weight_all_gather`: byte counts, and ``remove()``.

    qwZ keeps no state between steps (the same shard always gives the same bytes), so
    there is nothing to checkpoint; a resumed run quantises its loaded weights as the
    straight run quantised the same weights.
    """

    def __init__(
        self,
        comms: dict[str, tuple[FSDPModule, QuantizedWeightAllGather]],
        undo: list[Callable[[], None]] | None = None,
    ):
        self._comms = comms
        self._undo = undo or []
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
        for undo in reversed(self._undo):
            undo()
        self._removed = True


def register_weight_all_gather(
    model: torch.nn.Module,
    config: WeightQuantConfig | None = None,
    *,
    codec: Codec | None = None,
    overlap: bool = True,
) -> WeightGatherHandle:
    """Install a :class:`QuantizedWeightAllGather` on every FSDP unit of ``model``.

    Call it on every rank, after ``fully_shard`` (any wrap, mixed precision, experts on
    their own mesh, ``reshard_after_forward`` an int for hpZ). A unit with several param
    groups (per-parameter meshes through ``shard_placement_fn``) is refused, since FSDP2
    takes one all-gather comm per unit; so is a group size the CUDA kernels lack.
    ``config``: a weight codec's options (default :class:`WeightQuantConfig`); ``codec``:
    built from it once and shared by every unit (built here when not given).

    ``overlap`` (default on): each unit's gather runs behind the compute before it. FSDP
    calls the gathers with ``async_op=True`` (its ``unshard_async_op``, set on these units'
    param groups), so a prefetched gather returns at once and is waited for and decoded in
    the unit's own pre-forward or pre-backward; backward prefetches one unit ahead
    (FSDP2's default), and a unit with no forward prefetch set (by the wrap plan or the
    user) prefetches the next unit in module order, as ZeRO++ does. That keeps one more
    unit gathered at a time. ``overlap=False`` leaves FSDP's defaults: each gather runs to
    its end where FSDP asks for it. Both give the same bits; ``remove()`` undoes either.
    """
    config = config if config is not None else WeightQuantConfig()
    if not hasattr(config, "backward"):
        raise TypeError(
            f"config must be a weight codec's options (a WeightQuantConfig), got "
            f"{type(config).__name__}"
        )
    codec = codec if codec is not None else make_codec(config)
    if codec.keeps_feedback:
        raise ValueError(
            f"codec {config.codec!r} keeps error feedback; a weight all-gather takes a codec "
            "that is a pure function of the weights"
        )
    by_name: dict[str, tuple[FSDPModule, QuantizedWeightAllGather]] = {}
    for name, module, group in comm_units(model, "WeightQuantConfig"):
        if group is None or shard_process_group(group) is None:
            continue  # no parameter, or replicate-only (nothing is gathered)
        comm = QuantizedWeightAllGather(config, group, name, codec=codec)
        device = group_device(group)
        try:
            comm.codec.check_device(device)
        except ValueError as exc:
            raise ValueError(f"unit {name} gathers on {device}: {exc}") from exc
        by_name[name] = (module, comm)
    if not by_name:
        raise ValueError(
            "model has no FSDP unit to gather: call fully_shard before register_weight_all_gather"
        )
    for module, comm in by_name.values():
        module.set_custom_all_gather(comm)
    undo = _overlap_gathers(by_name) if overlap else []
    return WeightGatherHandle(by_name, undo)


def _overlap_gathers(
    by_name: dict[str, tuple[FSDPModule, QuantizedWeightAllGather]],
) -> list[Callable[[], None]]:
    """Asynchronous gathers on every unit, and a forward prefetch of the next unit (in
    module order, the root first) on each unit that has none; returns how to undo it."""
    undo: list[Callable[[], None]] = []
    for _, comm in by_name.values():
        group = comm.unit_group
        before = group_unshard_async_op(group)
        set_group_unshard_async_op(group, True)
        undo.append(lambda g=group, b=before: set_group_unshard_async_op(g, b))
    modules = [module for module, _ in by_name.values()]
    for unit, ahead in itertools.pairwise(modules):
        if not forward_prefetch_targets(unit):
            unit.set_modules_to_forward_prefetch([ahead])
            undo.append(lambda u=unit: u.set_modules_to_forward_prefetch([]))
    return undo
