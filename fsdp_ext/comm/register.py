"""One call to put LoCo on every FSDP unit of a model, and the handle that undoes it."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from fsdp_ext.comm.all_reduce_hook import LoCoAllReduceHook
from fsdp_ext.comm.config import LoCoConfig
from fsdp_ext.comm.hierarchical import NodeGroups, build_node_groups
from fsdp_ext.comm.reduce_scatter import LoCoReduceScatter
from fsdp_ext.comm.stats import CommStats

try:  # the stock comm; ``remove()`` puts it back
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter
except ImportError:  # pragma: no cover - layout of older torch
    DefaultReduceScatter = None


def _unit_params(unit: FSDPModule) -> list[DTensor]:
    """Parameters managed by ``unit`` itself: those not inside a nested FSDP unit."""
    nested = {
        id(p)
        for name, child in unit.named_modules()
        if name and isinstance(child, FSDPModule)
        for p in child.parameters()
    }
    return [p for p in unit.parameters() if id(p) not in nested and isinstance(p, DTensor)]


def _shard_layout(params: list[DTensor]) -> tuple[int, int, torch.device]:
    """(reduce-scatter output numel, shard group size, device) of a unit, as FSDP lays it out:
    each gradient padded on dim 0 to a multiple of the shard group size."""
    mesh = params[0].device_mesh
    world = mesh.size(mesh.ndim - 1)  # the shard dim (torch 2.11 meshes reject -1)
    numel = 0
    for p in params:
        if p.placements[-1].dim != 0:  # Shard(i > 0) requires even sharding
            numel += p.numel() // world
        elif p.shape[0]:
            numel += -(-p.shape[0] // world) * (p.numel() // p.shape[0])
    return numel, world, params[0].to_local().device


class _Unit:
    """LoCo state of one FSDP unit: its comm, hook, and the sizes to allocate buffers."""

    def __init__(self, module, reduce_scatter, all_reduce_hook, shard_numel, world, device):
        self.module = module
        self.reduce_scatter = reduce_scatter
        self.all_reduce_hook = all_reduce_hook
        self.shard_numel = shard_numel
        self.world = world
        self.device = device

    def materialize(self) -> None:
        rs = self.reduce_scatter
        if rs.feedback is not None and self.world > 1:
            rs.feedback.materialize(rs.error_numel(self.shard_numel, self.world), self.device)
        if self.all_reduce_hook is not None:
            self.all_reduce_hook.materialize(self.shard_numel, self.device)

    def state_dict(self) -> dict:
        state = dict(self.reduce_scatter.state_dict())
        if self.all_reduce_hook is not None:
            state.update(self.all_reduce_hook.state_dict())
        return state

    def load_state_dict(self, state: dict) -> None:
        self.reduce_scatter.load_state_dict(state)
        if self.all_reduce_hook is not None:
            self.all_reduce_hook.load_state_dict(state)


class CommHandle:
    """Returned by :func:`register_comm_hook`; a DCP ``Stateful`` holding every error buffer.

    Error buffers differ per rank, so the state is keyed by global rank: a checkpoint
    resumes on the same world size and rank layout.
    """

    def __init__(self, units: dict[str, _Unit]):
        self._units = units
        self._removed = False

    @property
    def stats(self) -> CommStats:
        """Totals over every unit: bytes sent, the uncompressed equivalent, reductions."""
        total = CommStats()
        for unit in self._units.values():
            total.add(unit.reduce_scatter.stats)
            if unit.all_reduce_hook is not None:
                total.add(unit.all_reduce_hook.stats)
        return total

    def reset_stats(self) -> None:
        for unit in self._units.values():
            unit.reduce_scatter.stats = CommStats()
            if unit.all_reduce_hook is not None:
                unit.all_reduce_hook.stats = CommStats()

    def state_dict(self) -> dict:
        for unit in self._units.values():
            unit.materialize()
        return {f"rank{dist.get_rank()}": {f: u.state_dict() for f, u in self._units.items()}}

    def load_state_dict(self, state_dict: dict) -> None:
        mine = state_dict[f"rank{dist.get_rank()}"]
        for fqn, unit in self._units.items():
            unit.load_state_dict(mine[fqn])

    def remove(self) -> None:
        """Give every unit back the stock reduce-scatter and no all-reduce hook."""
        if self._removed:
            return
        for unit in self._units.values():
            unit.module.set_custom_reduce_scatter(DefaultReduceScatter())
            if unit.all_reduce_hook is not None:
                unit.module.set_all_reduce_hook(None)
        self._removed = True


def register_comm_hook(
    model: torch.nn.Module,
    config: LoCoConfig | None = None,
    *,
    replicate_group: dist.ProcessGroup | None = None,
) -> CommHandle:
    """Install a :class:`LoCoReduceScatter` on every FSDP unit of ``model``.

    With ``replicate_group`` (HSDP), ``model`` must be sharded on the ``dp_shard`` mesh only;
    each unit also gets a :class:`LoCoAllReduceHook` that averages over the replicas.
    Call it on every rank, after ``fully_shard``.
    """
    config = config if config is not None else LoCoConfig()
    if not isinstance(config, LoCoConfig):
        raise TypeError(f"config must be a LoCoConfig, got {type(config).__name__}")
    fsdp_units = [(n, m) for n, m in model.named_modules() if isinstance(m, FSDPModule)]
    if not fsdp_units:
        raise ValueError("model has no FSDP unit: call fully_shard before register_comm_hook")
    node_groups: dict[tuple[int, ...], NodeGroups] = {}
    units: dict[str, _Unit] = {}
    for fqn, module in fsdp_units:
        params = _unit_params(module)
        if not params:
            continue
        if any(p.device_mesh.ndim != 1 for p in params) and replicate_group is not None:
            raise ValueError(
                f"unit {fqn or '<root>'} is sharded on a 2-D (HSDP) mesh; with "
                "replicate_group, shard on the dp_shard mesh only"
            )
        numel, world, device = _shard_layout(params)
        mesh = params[0].device_mesh
        shard_group = mesh.get_group(mesh.ndim - 1)
        config.check_group_size(world)
        groups = None
        if (config.intra_node_size or 1) > 1 and world > 1:
            key = tuple(dist.get_process_group_ranks(shard_group))
            if key not in node_groups:
                node_groups[key] = build_node_groups(shard_group, config.intra_node_size)
            groups = node_groups[key]
        comm = LoCoReduceScatter(config, node_groups=groups)
        try:
            module.set_custom_reduce_scatter(comm)
        except ValueError as exc:
            raise ValueError(
                f"unit {fqn or '<root>'} has several param groups (per-parameter meshes); "
                "give each mesh its own fully_shard call to use LoCo"
            ) from exc
        hook = None
        if replicate_group is not None:
            hook = LoCoAllReduceHook(config, replicate_group)
            module.set_all_reduce_hook(hook)
        units[fqn or "<root>"] = _Unit(module, comm, hook, numel, world, device)
    return CommHandle(units)
