"""``enable(model, CommConfig(...))``: the one call that turns on ZeRO++ for a sharded model.

ZeRO++ has three parts, and FSDP2 takes each at a different place:

- **gradients** (qgZ, here with LoCo error feedback): a custom reduce-scatter per unit, plus
  the all-reduce hook under HSDP;
- **weights** (qwZ): a custom all-gather per unit (:func:`register_weight_all_gather`);
- **hpZ** (secondary shards): ``reshard_after_forward`` = ranks per node, which FSDP2 takes
  only in ``fully_shard`` (it builds the post-forward group there). ``CommConfig`` carries
  the choice; whoever shards reads it (``examples/train.py``, the adapters and
  ``build_pipeline`` do, a user passes ``reshard_after_forward="node"`` to
  :func:`fsdp_ext.shard_by_policy`), and :func:`enable` checks that every unit's secondary
  group lies inside a node, so hpZ is never silently off.

The names ``CommConfig`` takes are the vocabulary of :mod:`fsdp_ext.comm.registry`
(``"stock"`` and every registered codec), the same names as ``--comm`` and ``--comm auto``.
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
from fsdp_ext.comm.register import CommHandle, install_gradient_codec
from fsdp_ext.comm.registry import CODECS, gradient_names, make_codec, preset, weight_names
from fsdp_ext.comm.weight_register import register_weight_all_gather
from fsdp_ext.node_size import resolve_node_size

__all__ = ["CommConfig", "enable"]


def _options(value: object, carries: str) -> object:
    """A name of the vocabulary as its preset; a codec's options as they are (checked)."""
    names = gradient_names() if carries == "gradients" else weight_names()
    if isinstance(value, str):
        if value not in names:
            raise ValueError(f"CommConfig.{carries} must be one of {list(names)}, got {value!r}")
        return preset(value, carries)
    if value is None:
        return None
    entry = CODECS.get(getattr(value, "codec", None))
    if entry is None or entry.carries != carries:
        raise ValueError(
            f"CommConfig.{carries} must be None, one of {list(names)} or the options of a "
            f"{carries} codec, got {value!r}"
        )
    return value


@dataclass(frozen=True)
class CommConfig:
    """What FSDP2 sends, per collective (the default: FSDP's stock collectives).

    ``gradients``: a name of :func:`~fsdp_ext.comm.registry.gradient_names` (``"stock"``,
    ``"loco"``, ``"q4"``, ...) or a gradient codec's options (``LoCoConfig(bits=8)``), for the
    reduce-scatter and, with ``enable(..., replicate_group=...)``, the HSDP all-reduce.
    ``weights``: a name of :func:`~fsdp_ext.comm.registry.weight_names` (``"stock"``,
    ``"int8"``, ``"int8_forward"``) or a weight codec's options (:class:`WeightQuantConfig`):
    qwZ. ``hpz``: each unit keeps its post-forward copy sharded over the ranks of its node,
    so backward gathers never leave the node (a sharding-time choice, see the module
    docstring). ``hierarchical``: the gradients reduce in full precision inside each node
    and send the codec's payload only between nodes. ``node_size``: ranks per node for both,
    an int or ``"auto"`` (the launcher's ``LOCAL_WORLD_SIZE``), global rank ``g`` on node
    ``g // node_size``. ``overlap`` (default on): each unit's weight gather runs behind the
    compute of the unit before it, and each unit's gradient exchange behind the backward of
    the unit before it (the same bits; one more unit's buffers alive); off, each collective
    blocks where FSDP calls it. Names become their presets here, so ``config.gradients`` and
    ``config.weights`` are always a codec's options or None.
    """

    gradients: object | None = None
    weights: object | None = None
    hpz: bool = False
    hierarchical: bool = False
    node_size: int | str = "auto"
    overlap: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "gradients", _options(self.gradients, "gradients"))
        object.__setattr__(self, "weights", _options(self.weights, "weights"))
        for name in ("hpz", "hierarchical", "overlap"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"CommConfig.{name} must be a bool, got {getattr(self, name)!r}")
        if self.hierarchical and self.gradients is None:
            raise ValueError(
                "CommConfig.hierarchical sends a gradient codec between nodes: set gradients "
                f"to one of {list(gradient_names()[1:])}, or leave hierarchical out"
            )
        k = self.node_size
        if k != "auto" and (not isinstance(k, int) or isinstance(k, bool) or k < 1):
            raise ValueError(f"CommConfig.node_size must be 'auto' or an int >= 1, got {k!r}")

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
    ranks per node, e.g. ``fsdp_ext.shard_by_policy(..., reshard_after_forward="node")``).
    ``replicate_group`` (HSDP with the model sharded on the ``dp_shard`` mesh): the gradient
    codec also runs the all-reduce between replicas. ``strict``: a checkpoint's error
    feedback that does not match raises instead of resetting (see :class:`CommHandle`).
    Each codec is built once here and shared by every unit.
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
        handle = install_gradient_codec(
            model,
            config.gradients,
            make_codec(config.gradients),
            node_size=config.node_size if config.hierarchical else None,
            replicate_group=replicate_group,
            strict=strict,
            overlap=config.overlap,
        )
    else:
        handle = CommHandle({}, None, strict=strict)
    if config.weights is not None:
        handle.weights = register_weight_all_gather(
            model, config.weights, codec=make_codec(config.weights), overlap=config.overlap
        )
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
                f"CommConfig.hpz: unit {fqn} keeps its post-forward copy "
                f"on ranks {spans[0]}, which span nodes of {node} ranks, so its backward "
                "all-gather leaves the node; shard with reshard_after_forward='node' "
                "(fsdp_ext.shard_by_policy) or fsdp_ext.node_local_reshard(mesh, node_size)"
            )
    return sizes
