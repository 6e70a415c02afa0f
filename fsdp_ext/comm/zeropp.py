"""``enable(model, CommConfig(...))``: the one call that turns on ZeRO++ for a sharded model.

ZeRO++ has three parts, and FSDP2 takes each at a different place:

- **gradients** (qgZ, here with LoCo error feedback): a custom reduce-scatter per unit, plus
  the all-reduce hook under HSDP (:func:`register_comm_hook`);
- **weights** (qwZ): a custom all-gather per unit (:func:`register_weight_all_gather`);
- **secondary shards** (hpZ): ``reshard_after_forward`` = ranks per node, which FSDP2 takes
  only in ``fully_shard`` (it builds the post-forward group there). ``CommConfig`` carries
  the choice; whoever shards reads it (the adapters and ``build_pipeline`` do, a user passes
  ``reshard_after_forward="node"`` to :func:`fsdp_ext.fully_shard`), and :func:`enable`
  checks that every unit's secondary group lies inside a node, so hpZ is never silently off.

As torchao's ``Float8LinearConfig(enable_fsdp_float8_all_gather=...)`` and torchtitan's
converter configs do, the switches are one validated dataclass and the call that applies
them is one function; the handle it returns undoes everything with ``remove()``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from fsdp_ext._torch import (
    fsdp_state_id,
    group_reshard_after_forward,
    param_groups,
    shard_process_group,
)
from fsdp_ext.comm.config import LoCoConfig
from fsdp_ext.comm.register import CommHandle, register_comm_hook
from fsdp_ext.comm.weight_config import WeightQuantConfig
from fsdp_ext.comm.weight_register import register_weight_all_gather
from fsdp_ext.node_size import resolve_node_size

__all__ = ["GRADIENT_PRESETS", "SECONDARY_SHARDS", "WEIGHT_PRESETS", "CommConfig", "enable"]

# the short names CommConfig takes, and the configs they stand for
GRADIENT_PRESETS = {
    "loco": LoCoConfig(),  # 4-bit with LoCo error feedback
    "q4": LoCoConfig(error_feedback=False),  # 4-bit absmax, ZeRO++'s qgZ
}
WEIGHT_PRESETS = {
    "int8": WeightQuantConfig(),  # forward and backward gathers
    "int8_forward": WeightQuantConfig(backward=False),  # backward gathers full precision
}
SECONDARY_SHARDS = (None, "node")


@dataclass(frozen=True)
class CommConfig:
    """What FSDP2 sends, per collective (every field None: FSDP's stock collectives).

    ``gradients``: ``"loco"``, ``"q4"`` or a :class:`LoCoConfig` (4-/8-bit reduce-scatter,
    and HSDP all-reduce with ``enable(..., replicate_group=...)``).
    ``weights``: ``"int8"``, ``"int8_forward"`` or a :class:`WeightQuantConfig` (qwZ).
    ``secondary_shards``: ``"node"`` for hpZ (each unit keeps its post-forward copy sharded
    over the ranks of its node, so backward gathers never leave the node); a sharding-time
    choice, see the module docstring. ``node_size``: ranks per node for hpZ, an int or
    ``"auto"`` (the launcher's ``LOCAL_WORLD_SIZE``); gradients take theirs from
    ``LoCoConfig.intra_node_size``. Short names become their configs here, so
    ``config.gradients`` and ``config.weights`` are always a config or None.
    """

    gradients: LoCoConfig | str | None = None
    weights: WeightQuantConfig | str | None = None
    secondary_shards: str | None = None
    node_size: int | str = "auto"

    def __post_init__(self) -> None:
        g = self.gradients
        if isinstance(g, str) and g in GRADIENT_PRESETS:
            object.__setattr__(self, "gradients", GRADIENT_PRESETS[g])
        elif g is not None and not isinstance(g, LoCoConfig):
            raise ValueError(
                f"CommConfig.gradients must be None, one of {sorted(GRADIENT_PRESETS)} or a "
                f"LoCoConfig, got {g!r}"
            )
        w = self.weights
        if isinstance(w, str) and w in WEIGHT_PRESETS:
            object.__setattr__(self, "weights", WEIGHT_PRESETS[w])
        elif w is not None and not isinstance(w, WeightQuantConfig):
            raise ValueError(
                f"CommConfig.weights must be None, one of {sorted(WEIGHT_PRESETS)} or a "
                f"WeightQuantConfig, got {w!r}"
            )
        if self.secondary_shards not in SECONDARY_SHARDS:
            raise ValueError(
                f"CommConfig.secondary_shards must be one of {SECONDARY_SHARDS}, "
                f"got {self.secondary_shards!r}"
            )
        k = self.node_size
        if k != "auto" and (not isinstance(k, int) or isinstance(k, bool) or k < 1):
            raise ValueError(f"CommConfig.node_size must be 'auto' or an int >= 1, got {k!r}")

    @property
    def hpz(self) -> bool:
        """Whether the units keep node-local secondary shards (``secondary_shards="node"``)."""
        return self.secondary_shards == "node"

    @property
    def enabled(self) -> bool:
        """Whether anything differs from FSDP's stock collectives."""
        return self.gradients is not None or self.weights is not None or self.hpz


def enable(
    model: torch.nn.Module,
    config: CommConfig | None = None,
    *,
    replicate_group: dist.ProcessGroup | None = None,
    strict: bool = False,
) -> CommHandle:
    """Turn on what ``config`` asks for on every FSDP unit of ``model``; one handle back.

    Call it on every rank, after ``fully_shard`` (hpZ: with ``reshard_after_forward`` =
    ranks per node, e.g. ``fsdp_ext.fully_shard(..., reshard_after_forward="node")``).
    ``replicate_group`` (HSDP with the model sharded on the ``dp_shard`` mesh): the gradient
    codec also runs the all-reduce between replicas. ``strict``: a checkpoint's LoCo state
    that does not match raises instead of resetting (see :class:`CommHandle`).
    """
    config = CommConfig() if config is None else config
    if not isinstance(config, CommConfig):
        raise TypeError(f"config must be a CommConfig, got {type(config).__name__}")
    if replicate_group is not None and config.gradients is None:
        raise ValueError(
            "replicate_group carries the gradient codec's HSDP all-reduce: set "
            "CommConfig.gradients, or leave replicate_group out for FSDP's own all-reduce"
        )
    units = _units(model)
    if not units:
        raise ValueError("model has no FSDP unit: call fully_shard before fsdp_ext.comm.enable")
    secondary = _check_secondary_shards(units, config) if config.hpz else {}
    if config.gradients is not None:
        handle = register_comm_hook(
            model, config.gradients, replicate_group=replicate_group, strict=strict
        )
    else:
        handle = CommHandle({}, None, strict=strict)
    if config.weights is not None:
        handle.weights = register_weight_all_gather(model, config.weights)
    handle.secondary_shards = secondary
    return handle


def _units(model: torch.nn.Module) -> dict[str, object]:
    """Each unit's first param group, by the name of its first module."""
    found: dict[int, tuple[str, object]] = {}
    for fqn, module in model.named_modules():
        if isinstance(module, FSDPModule) and fsdp_state_id(module) not in found:
            groups = param_groups(module)
            found[fsdp_state_id(module)] = (fqn or "<root>", groups[0] if groups else None)
    return dict(found.values())


def _check_secondary_shards(units: dict[str, object], config: CommConfig) -> dict[str, bool | int]:
    """Each unit's post-forward group size, checked to lie inside a node: a unit that
    reshards fully across nodes (hpZ silently off) or in blocks that span nodes is refused."""
    node = resolve_node_size(config.node_size)
    sizes: dict[str, bool | int] = {}
    for fqn, group in units.items():
        pg = None if group is None else shard_process_group(group)
        if pg is None:
            continue  # no parameter, or replicate-only
        ranks = dist.get_process_group_ranks(pg)
        kept = group_reshard_after_forward(group)
        sizes[fqn] = kept
        if kept is False:
            continue  # the unsharded copy is kept: backward gathers nothing
        block = len(ranks) if kept is True else kept
        spans = [
            ranks[i : i + block]
            for i in range(0, len(ranks), block)
            if len({r // node for r in ranks[i : i + block]}) > 1
        ]
        if spans:
            raise ValueError(
                f"CommConfig.secondary_shards='node': unit {fqn} keeps its post-forward copy "
                f"on ranks {spans[0]}, which span nodes of {node} ranks, so its backward "
                "all-gather leaves the node; shard with reshard_after_forward='node' "
                "(fsdp_ext.fully_shard) or fsdp_ext.node_local_reshard(mesh, node_size)"
            )
    return sizes
