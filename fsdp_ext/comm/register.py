"""Putting a gradient codec on every FSDP unit of a model (``fsdp_ext.comm.enable`` does),
and the handle that undoes everything ``enable`` turned on."""

from __future__ import annotations

import io
import logging

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from fsdp_ext._torch import (
    DefaultReduceScatter,
    canonical_fqn,
    group_device,
    is_hsdp_group,
    shard_process_group,
    trainable_fsdp_params,
)
from fsdp_ext.comm.all_reduce_hook import LoCoAllReduceHook
from fsdp_ext.comm.codec import Codec, WireChoice
from fsdp_ext.comm.hierarchical import NodeGroups, all_shard_groups, build_node_groups
from fsdp_ext.comm.reduce_scatter import LoCoReduceScatter
from fsdp_ext.comm.stats import CommStats
from fsdp_ext.comm.unit import (
    SUPPORTED_REDUCE_DTYPES,
    UnitBinding,
    comm_units,
    reduce_dtype_of,
)
from fsdp_ext.comm.weight_all_gather import WeightGatherStats
from fsdp_ext.comm.weight_register import WeightGatherHandle
from fsdp_ext.node_size import resolve_node_size

#: the codec of checkpoints written before codecs had names
UNNAMED_CODEC = "loco"

logger = logging.getLogger("fsdp_ext.comm")


class _Unit:
    """LoCo state of one FSDP unit: its binding, comm, hook, and shard group size."""

    def __init__(self, module, binding, reduce_scatter, all_reduce_hook, world):
        self.module = module
        self.binding = binding
        self.reduce_scatter = reduce_scatter
        self.all_reduce_hook = all_reduce_hook
        self.world = world

    def materialize(self) -> None:
        """Allocate not-yet-used buffers (on the reduction's device) so a load can fill them."""
        rs, device = self.reduce_scatter, self.binding.device
        rows = rs.rows(self.world)
        if rs.feedback is not None and rows > 1:
            width = rs.codec.padded(self.binding.layout.width)
            rs.feedback.materialize(rows * width, device)
        if self.all_reduce_hook is not None:
            self.all_reduce_hook.materialize(device)

    def feedbacks(self) -> list:
        out = [self.reduce_scatter.feedback]
        if self.all_reduce_hook is not None:
            out += [self.all_reduce_hook.scatter_feedback, self.all_reduce_hook.gather_feedback]
        return [f for f in out if f is not None]

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
    """Returned by :func:`fsdp_ext.comm.enable`: one handle for everything that is on.
    ``stats`` counts the gradients' bytes, ``weight_stats`` qwZ's; ``weights`` is qwZ's handle and
    ``secondary_shards`` hpZ's secondary group per unit; ``remove()`` gives every unit back
    FSDP's stock collectives. It is a DCP ``Stateful`` holding every error buffer (an empty
    state when the gradients are left to FSDP).

    Each rank saves its own buffers with a header: world size, config, and every unit's
    parameter layout (names and lengths, and a signature of them). Units and parameters are
    named canonically, as DCP's state-dict helpers name them (no ``_checkpoint_wrapped_module``
    or ``_orig_mod``), so adding or removing ``checkpoint_wrapper`` or ``torch.compile``
    between save and resume keeps the buffers. A load checks the header first. A different
    ``bits`` or ``error_dtype`` always raises (the stored values mean something else). A
    different world size, node size, group size, ``err_beta`` or layout resets the buffers,
    with one warning line naming what differs (for a layout: which parameters), since error
    feedback is an optimisation state and training stays correct; with ``strict=True`` it
    raises, naming what differs. The same layout resumes bit for bit.
    """

    def __init__(
        self,
        units: dict[str, _Unit],
        config: object | None = None,
        codec: Codec | None = None,
        *,
        node_size: int | None = None,
        strict: bool = False,
    ):
        self._units = units
        self._config = config  # None: gradients left to FSDP (qwZ / hpZ alone)
        self._codec = codec
        self._node_size = node_size  # hierarchical mode's ranks per node (None: flat)
        self.strict = strict
        self._removed = False
        self.weights: WeightGatherHandle | None = None  # qwZ's part, when it is on
        # hpZ: each unit's reshard_after_forward (the secondary group's size), when it is on
        self.secondary_shards: dict[str, bool | int] = {}

    @property
    def gradient_config(self) -> object | None:
        """The gradient codec's options (None: FSDP's own reduce-scatter)."""
        return self._config

    @property
    def weight_stats(self) -> WeightGatherStats:
        """qwZ's bytes (payload and the param-dtype equivalent); zeros when qwZ is off."""
        return WeightGatherStats() if self.weights is None else self.weights.stats

    @property
    def stats(self) -> CommStats:
        """Totals over every unit: bytes sent, the uncompressed equivalent, reductions."""
        total = CommStats()
        for unit in self._units.values():
            total.add(unit.reduce_scatter.stats)
            if unit.all_reduce_hook is not None:
                total.add(unit.all_reduce_hook.stats)
        return total

    @property
    def units(self) -> dict[str, FSDPModule]:
        """Every unit LoCo is on, by name (``"<root>"``; a unit of several modules is named
        by their names joined with ``"+"``)."""
        return {fqn: unit.module for fqn, unit in self._units.items()}

    @property
    def reduce_scatters(self) -> dict[str, LoCoReduceScatter]:
        """The reduce-scatter installed on each unit, by the names of :attr:`units`."""
        return {fqn: unit.reduce_scatter for fqn, unit in self._units.items()}

    @property
    def wire_choices(self) -> dict[str, WireChoice]:
        """Per unit: its gradient rows' payload and plain bytes, and whether they are
        encoded (units whose payload would be larger go plain); see ``weights`` for qwZ."""
        return {fqn: unit.reduce_scatter.wire for fqn, unit in self._units.items()}

    def reset_stats(self) -> None:
        for unit in self._units.values():
            unit.reduce_scatter.stats = CommStats()
            if unit.all_reduce_hook is not None:
                unit.all_reduce_hook.stats = CommStats()
        if self.weights is not None:
            self.weights.reset_stats()

    def header(self) -> dict:
        """What a saved error state must match to be loaded as is: the job's shape, the
        codec's name and its own header (:meth:`~fsdp_ext.comm.codec.Codec.header`)."""
        cfg = self._config
        return {
            "world_size": dist.get_world_size(),
            "node_size": self._node_size,
            "layout": {fqn: u.binding.layout.signature() for fqn, u in self._units.items()},
            "parameters": {fqn: _named_lengths(u.binding.layout) for fqn, u in self._units.items()},
            "codec": cfg.codec,  # the registry name
            **self._codec.header(),
        }

    def state_dict(self) -> dict:
        """``{"rank{r}": bytes}``: per-rank bytes, so a checkpoint from another world size or
        layout still loads through DCP (no size check) and reaches the header check."""
        if self._config is None:
            return {}  # no error buffers: qwZ and hpZ keep no state between steps
        for unit in self._units.values():
            unit.materialize()
        state = {
            "header": self.header(),
            "units": {fqn: u.state_dict() for fqn, u in self._units.items()},
        }
        buffer = io.BytesIO()
        torch.save(state, buffer)
        # plain bytes: DCP pickles the value, and only builtins pass a weights_only load
        return {f"rank{dist.get_rank()}": buffer.getvalue()}

    def load_state_dict(self, state_dict: dict) -> None:
        if self._config is None:
            return
        mine = state_dict.get(f"rank{dist.get_rank()}")
        if isinstance(mine, bytes):
            mine = torch.load(io.BytesIO(mine), weights_only=True)
        now = self.header()
        if mine is None:
            differences = [f"the checkpoint holds no LoCo state for rank {dist.get_rank()}"]
        else:
            # checkpoints from before codecs had names hold the default codec's header
            saved = {"codec": UNNAMED_CODEC, **mine["header"]}
            for key in ("codec", *self._codec.format_keys):
                if saved.get(key) != now[key]:
                    raise ValueError(
                        f"LoCo checkpoint has {key}={saved.get(key)}, this run has "
                        f"{key}={now[key]}: its error buffers cannot be read with another {key}"
                    )
            differences = [
                f"{key} {saved.get(key)} -> {now[key]}"
                for key in now
                if key not in ("layout", "parameters") and saved.get(key) != now[key]
            ]
            changed = sorted(
                fqn
                for fqn in set(saved["layout"]) | set(now["layout"])
                if saved["layout"].get(fqn) != now["layout"].get(fqn)
            )
            if changed:
                causes = layout_changes(changed, saved.get("parameters"), now["parameters"])
                differences.append(f"parameter layout of units {', '.join(changed)}: {causes}")
        if differences:
            message = "LoCo error state does not match this run (" + "; ".join(differences) + ")"
            if self.strict:
                raise ValueError(message + "; strict=True refuses to reset it")
            logger.warning("%s: error buffers reset, training continues", message)
            for unit in self._units.values():
                for feedback in unit.feedbacks():
                    feedback.forget()
            return
        for fqn, unit in self._units.items():
            unit.load_state_dict(mine["units"][fqn])

    def remove(self) -> None:
        """Give every unit back the stock reduce-scatter and no all-reduce hook."""
        if self._removed:
            return
        for unit in self._units.values():
            unit.module.set_custom_reduce_scatter(DefaultReduceScatter())
            if unit.all_reduce_hook is not None:
                unit.module.set_all_reduce_hook(None)
            unit.binding.remove()
        if self.weights is not None:
            self.weights.remove()
        self._removed = True


def _named_lengths(layout) -> list[list]:
    return [[n, k] for n, k in zip(layout.names, layout.lengths, strict=True)]


def layout_changes(
    units: list[str],
    saved: dict[str, list[list]] | None,
    now: dict[str, list[list]],
) -> str:
    """What differs in the parameter layout of ``units``, unit by unit: a unit only on one
    side, parameters only on one side, lengths, order (``saved`` None: a checkpoint from
    before names were saved)."""
    if saved is None:
        return "the checkpoint predates saved parameter names (other names or sizes)"
    parts = []
    for unit in units:
        if unit not in saved:
            parts.append(f"{unit} is not in the checkpoint")
            continue
        if unit not in now:
            parts.append(f"{unit} is only in the checkpoint")
            continue
        old, new = dict(map(tuple, saved[unit])), dict(map(tuple, now[unit]))
        found = []
        if gone := [n for n in old if n not in new]:
            found.append(f"parameters only in the checkpoint: {', '.join(gone)}")
        if added := [n for n in new if n not in old]:
            found.append(f"parameters only in this run: {', '.join(added)}")
        if resized := [f"{n} {old[n]} -> {new[n]}" for n in new if n in old and old[n] != new[n]]:
            found.append(f"lengths: {', '.join(resized)}")
        if not found:
            found.append("parameter order")
        parts.append(f"{unit} ({'; '.join(found)})")
    return "; ".join(parts)


def check_codec_device(codec: Codec, device: torch.device, fqn: str) -> None:
    """Refuse, at registration, a codec setting the kernels on ``device`` cannot run (e.g. a
    group size the CUDA kernels are not tiled for): the middle of the first backward would
    be too late to find out."""
    try:
        codec.check_device(device)
    except ValueError as exc:
        raise ValueError(f"unit {fqn} reduces on {device}: {exc}") from exc


def install_gradient_codec(
    model: torch.nn.Module,
    config: object,
    codec: Codec,
    *,
    node_size: int | str | None = None,
    replicate_group: dist.ProcessGroup | None = None,
    strict: bool = False,
    overlap: bool = True,
) -> CommHandle:
    """Install a :class:`LoCoReduceScatter` sending ``codec`` (built from ``config``, its
    options) on every FSDP unit of ``model``; :func:`fsdp_ext.comm.enable` calls it.

    Every unit gets its own comm, sized over all of its trainable parameters (a unit of
    several modules, ``fully_shard([a, b])``, included), and all share the one codec.
    ``node_size``: hierarchical mode (full precision inside nodes of that many ranks, the
    codec across them). With ``replicate_group`` (HSDP), ``model`` must be sharded on the
    ``dp_shard`` mesh only; each unit also gets a :class:`LoCoAllReduceHook`. ``strict``
    governs checkpoint loads (see :class:`CommHandle`). ``overlap``: each unit's exchange
    runs behind the backward of the unit before (:class:`LoCoReduceScatter`). Unsupported
    reduce dtypes are refused.
    """
    if not isinstance(strict, bool):
        raise TypeError(f"strict must be a bool, got {strict!r}")
    units_found = comm_units(model, "a gradient codec")
    if not units_found:
        raise ValueError("model has no FSDP unit: call fully_shard before fsdp_ext.comm.enable")
    names = {
        id(p): canonical_fqn(model, n) for n, p in model.named_parameters(remove_duplicate=False)
    }
    plans = []
    for fqn, module, group in units_found:
        fqn = "+".join(canonical_fqn(model, part) or "<root>" for part in fqn.split("+"))
        if group is None or not trainable_fsdp_params(group):
            continue
        shard_group = shard_process_group(group)
        if shard_group is None:
            continue  # replicate-only (DDP) units have no reduce-scatter
        if replicate_group is not None and is_hsdp_group(group):
            raise ValueError(
                f"unit {fqn} is sharded on a 2-D (HSDP) mesh; with replicate_group, shard on "
                "the dp_shard mesh only"
            )
        dtype = reduce_dtype_of(group)
        if dtype not in SUPPORTED_REDUCE_DTYPES:
            raise ValueError(
                f"unit {fqn} reduces gradients in {dtype}; the gradient codecs support reduce "
                "dtypes torch.float32, torch.bfloat16 and torch.float16 (set "
                "MixedPrecisionPolicy.reduce_dtype)"
            )
        check_codec_device(codec, group_device(group), fqn)
        plans.append((fqn, module, group, shard_group))
    node_groups: dict[tuple[int, ...], NodeGroups] = {}
    resolved = None
    if node_size is not None:
        resolved = resolve_node_size(node_size)
        if dist.get_world_size() % resolved:
            raise ValueError(
                f"node_size must divide the world size {dist.get_world_size()} "
                f"(ranks per node), got {resolved}"
            )
        mine = [dist.get_process_group_ranks(pg) for *_, pg in plans if pg.size() > 1]
        node_groups = build_node_groups(all_shard_groups(mine), resolved)
    units: dict[str, _Unit] = {}
    for fqn, module, group, shard_group in plans:
        binding = UnitBinding(group, names, fqn)
        key = tuple(dist.get_process_group_ranks(shard_group))
        comm = LoCoReduceScatter(
            config,
            codec=codec,
            node_size=resolved,
            node_groups=node_groups.get(key),
            overlap=overlap,
        )
        comm.bind(binding)
        module.set_custom_reduce_scatter(comm)
        hook = None
        if replicate_group is not None:
            hook = LoCoAllReduceHook(config, replicate_group, codec=codec, unit=binding)
            module.set_all_reduce_hook(hook)
        units[fqn] = _Unit(module, binding, comm, hook, shard_group.size())
    return CommHandle(units, config, codec, node_size=resolved, strict=strict)
