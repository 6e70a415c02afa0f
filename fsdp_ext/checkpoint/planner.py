"""Global save planning that spreads replicated writes over every rank that holds them.

Stock DCP (``_dedup_save_plans.py``) gives each replicated item, in insertion order, to the
rank that has written the fewest bytes so far and never splits one, so a 1 GB embedding on
a 128-rank job makes one rank write 8x the mean. Here replicated items go largest first to
the least-loaded holder (LPT), counting the sharded bytes each rank writes anyway, and a
replicated tensor that does not fit under the fair share is cut along dim 0 (or, when
dim-0 slices are too coarse, the first dim whose slices are fine) into chunks written by
different ranks. DCP metadata records chunks, so any reader loads it whole.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import (
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)

from fsdp_ext._torch import DedupHookSavePlanner
from fsdp_ext.checkpoint.layers import LayerKey, default_layer_key, layer_of
from fsdp_ext.checkpoint.serialize import saved_value

# A group that fits under (1 + slack) x the fair share is placed whole, not split.
DEFAULT_SLACK = 0.02

ItemKey = tuple[str, tuple[int, ...]]


def item_key(index: MetadataIndex) -> ItemKey:
    """What identifies one write item across ranks: its fqn and chunk offset."""
    return index.fqn, tuple(index.offset) if index.offset is not None else ()


def item_nbytes(item: WriteItem) -> int:
    """Bytes of the chunk this item writes (0 for a pickled non-tensor: size unknown)."""
    if item.type == WriteItemType.BYTE_IO or item.tensor_data is None:
        return 0
    chunk = item.tensor_data.chunk
    sizes = chunk.sizes if chunk is not None else item.tensor_data.size
    return math.prod(sizes) * item.tensor_data.properties.dtype.itemsize


# A split cuts along dim 0 unless one dim-0 slice is more than this fraction of the fair
# share; then along the first dim whose slices are that fine (fused MoE experts are
# [experts, out, in]: 8 slices along dim 0 would be far too coarse at scale).
SLICE_FRACTION = 0.01


def _split_dim(item: WriteItem, fair: float) -> tuple[int, int]:
    """(dim, slices along it) for cutting ``item``; (0, 1) when it cannot be cut."""
    if item.type == WriteItemType.BYTE_IO or item.tensor_data is None:
        return 0, 1
    sizes = item.tensor_data.chunk.sizes
    if len(sizes) == 0:
        return 0, 1
    nbytes = item_nbytes(item)
    for dim, n in enumerate(sizes):
        if n > 1 and nbytes / n <= SLICE_FRACTION * fair:
            return dim, n
    dim = max(range(len(sizes)), key=lambda d: (sizes[d], -d))
    return dim, sizes[dim]


def _slice(item: WriteItem, dim: int, start: int, length: int) -> WriteItem:
    """The write item for [start, start + length) of ``item`` along ``dim``."""
    data = item.tensor_data
    if start == 0 and length == data.chunk.sizes[dim]:
        return item
    offsets = list(data.chunk.offsets)
    sizes = list(data.chunk.sizes)
    offsets[dim] += start
    sizes[dim] = length
    offsets, sizes = torch.Size(offsets), torch.Size(sizes)
    return WriteItem(
        index=MetadataIndex(item.index.fqn, offsets),
        type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
            properties=data.properties,
            size=data.size,
        ),
    )


@dataclass
class _Group:
    """Replicated items of one layer with the same holders: placed together if possible."""

    holders: tuple[int, ...]
    items: list[WriteItem]
    nbytes: int
    name: str


def spread_plans(
    all_plans: Sequence[SavePlan],
    *,
    layer_key: LayerKey | None = default_layer_key,
    split_replicated: bool = True,
    slack: float = DEFAULT_SLACK,
) -> list[SavePlan]:
    """Deduplicate ``all_plans``: every item written once, replicated bytes balanced.

    Pure and deterministic: it depends only on the plans (ties break on rank and key), so
    every rank that runs it on the same plans gets the same answer. Items held by one rank
    (FSDP shards) stay there. Replicated groups go most-constrained first (fewest holders),
    then largest first, to the least-loaded holder; a layer's items follow each other onto
    the same rank while they fit under ``(1 + slack)`` x the fair share. With
    ``split_replicated`` an item that does not fit is cut (see ``_split_dim``) and water-filled over
    its least-loaded holders; without it, whole groups go where LPT puts them.
    """
    if slack < 0:
        raise ValueError(f"slack must be >= 0, got {slack!r}")
    world = len(all_plans)
    holders: dict[ItemKey, list[int]] = defaultdict(list)
    first: dict[ItemKey, WriteItem] = {}
    for rank, plan in enumerate(all_plans):
        for item in plan.items:
            key = item_key(item.index)
            holders[key].append(rank)
            first.setdefault(key, item)

    load = [0] * world
    kept: list[list[WriteItem]] = [[] for _ in range(world)]
    groups: dict[tuple, _Group] = {}
    for key, hs in holders.items():
        item = first[key]
        layer = layer_of(layer_key, key[0])  # checked for every key, sharded ones too
        if len(hs) == 1:
            load[hs[0]] += item_nbytes(item)
            continue
        gid = (tuple(hs), layer) if layer is not None else (tuple(hs), None, key)
        group = groups.get(gid)
        if group is None:
            group = groups[gid] = _Group(tuple(hs), [], 0, layer or key[0])
        group.items.append(item)
        group.nbytes += item_nbytes(item)

    total = sum(load) + sum(g.nbytes for g in groups.values())
    fair = total / world if world else 0.0
    cap = fair * (1 + slack)
    placed: list[list[WriteItem]] = [[] for _ in range(world)]

    def least_loaded(hs: tuple[int, ...]) -> int:
        return min(hs, key=lambda r: (load[r], r))

    def put(rank: int, item: WriteItem) -> None:
        placed[rank].append(item)
        load[rank] += item_nbytes(item)

    def water_fill(item: WriteItem, hs: tuple[int, ...]) -> None:
        nbytes = item_nbytes(item)
        dim, slices = _split_dim(item, fair)
        slice_bytes = nbytes / slices
        order = sorted(hs, key=lambda r: (load[r], r))
        level = max(_water_level([load[r] for r in order], nbytes), fair)
        start = 0
        for rank in order:
            if start == slices:
                break
            want = level - load[rank]
            if want <= 0:
                continue
            take = min(slices - start, max(1, math.ceil(want / slice_bytes)))
            put(rank, _slice(item, dim, start, take))
            start += take
        if start < slices:  # rounding left slices over: they go to the least loaded
            put(least_loaded(hs), _slice(item, dim, start, slices - start))

    ordered = sorted(groups.values(), key=lambda g: (len(g.holders), -g.nbytes, g.name, g.holders))
    for group in ordered:
        hs = group.holders
        rank = least_loaded(hs)
        if not split_replicated or load[rank] + group.nbytes <= cap:
            for item in group.items:
                put(rank, item)
            continue
        # Too big for one rank: keep filling the current rank while items fit, cut the
        # one that does not, then continue on whichever holder is least loaded.
        for item in sorted(group.items, key=lambda i: (-item_nbytes(i), item_key(i.index))):
            if load[rank] + item_nbytes(item) > cap:
                rank = least_loaded(hs)
            if load[rank] + item_nbytes(item) <= cap or _split_dim(item, fair)[1] == 1:
                put(rank, item)
            else:
                water_fill(item, hs)
                rank = least_loaded(hs)

    for rank, plan in enumerate(all_plans):
        kept[rank] = [i for i in plan.items if len(holders[item_key(i.index)]) == 1]
    return [
        dataclasses.replace(plan, items=kept[rank] + placed[rank])
        for rank, plan in enumerate(all_plans)
    ]


def _water_level(sorted_loads: list[int], nbytes: int) -> float:
    """The level L with sum(max(0, L - load)) == nbytes over the given (sorted) loads."""
    filled = 0
    for i, load in enumerate(sorted_loads):
        nxt = sorted_loads[i + 1] if i + 1 < len(sorted_loads) else math.inf
        width = i + 1
        # raising the lowest `width` ranks from `load` to `nxt` absorbs width*(nxt-load)
        level = (nbytes - filled) / width + load
        if level <= nxt:
            return level
        filled += width * (nxt - load)
    return math.inf  # unreachable: the last step has nxt = inf


class SpreadSavePlanner(DedupHookSavePlanner):
    """A ``DefaultSavePlanner`` whose global step spreads replicated writes (LPT + split).

    Use it through the stock calls: ``dcp.save(state, storage_writer=...,
    planner=SpreadSavePlanner())``; ``dcp.async_save`` too. ``layer_key`` maps an fqn to a
    layer id (``None``: not in a layer); ``split_replicated=False`` never cuts a tensor.
    """

    def __init__(
        self,
        flatten_state_dict: bool = True,
        flatten_sharded_tensors: bool = True,
        dedup_replicated_tensors: bool | None = None,
        dedup_save_to_lowest_rank: bool = False,
        enable_plan_caching: bool = False,
        *,
        layer_key: LayerKey | None = default_layer_key,
        split_replicated: bool = True,
        slack: float = DEFAULT_SLACK,
    ) -> None:
        """Stock ``DefaultSavePlanner``'s arguments, in its order, then ours.

        ``dedup_save_to_lowest_rank=True`` gives stock's placement (each replicated item
        from the lowest rank holding it: no spreading). ``enable_plan_caching=True`` is
        accepted with a warning and changes nothing: a cached plan would name the previous
        save's version directory, and the spread is cheap next to the writing.
        """
        if not isinstance(split_replicated, bool):
            raise TypeError(f"split_replicated must be a bool, got {split_replicated!r}")
        if layer_key is not None and not callable(layer_key):
            raise TypeError(
                f"layer_key must be a callable fqn -> layer id or None, got {layer_key!r}"
            )
        if slack < 0:
            raise ValueError(f"slack must be >= 0, got {slack!r}")
        if enable_plan_caching:
            warnings.warn(
                "SpreadSavePlanner(enable_plan_caching=True): plans are made afresh for every "
                "save (SpreadFileSystemWriter writes each save into a new version directory "
                "that the plan names, so a cached plan would point at the previous one); "
                "the option changes nothing",
                stacklevel=2,
            )
        super().__init__(
            flatten_state_dict=flatten_state_dict,
            flatten_sharded_tensors=flatten_sharded_tensors,
            dedup_replicated_tensors=dedup_replicated_tensors,
            dedup_save_to_lowest_rank=dedup_save_to_lowest_rank,
            enable_plan_caching=False,
        )
        self.layer_key = layer_key
        self.split_replicated = split_replicated
        self.slack = slack
        self._slices: dict[ItemKey, tuple[MetadataIndex, int, int, int]] = {}

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        self._local_items = list(plan.items)
        return plan

    def dedup_plans(self, all_plans: list[SavePlan]) -> list[SavePlan]:
        if self.dedup_save_to_lowest_rank:
            return super().dedup_plans(all_plans)
        return spread_plans(
            all_plans,
            layer_key=self.layer_key,
            split_replicated=self.split_replicated,
            slack=self.slack,
        )

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        """Remember which of this rank's items are pieces of a local tensor.

        A piece is recognised by its chunk, not its key: the first piece of a split starts
        at the local tensor's own offset, so it shares the key (fqn, offset) of the whole.
        """
        plan = super().finish_plan(new_plan)
        local = {item_key(i.index): i for i in self._local_items}
        self._slices = {}
        for item in plan.items:
            key = item_key(item.index)
            if item.tensor_data is None:
                continue
            held = local.get(key)
            if held is not None and held.tensor_data.chunk.sizes == item.tensor_data.chunk.sizes:
                continue  # written whole, as held
            base = _containing_item(self._local_items, item)
            piece, whole = item.tensor_data.chunk, base.tensor_data.chunk
            dim = next(d for d in range(len(piece.sizes)) if piece.sizes[d] != whole.sizes[d])
            start = piece.offsets[dim] - whole.offsets[dim]
            self._slices[key] = (base.index, dim, start, piece.sizes[dim])
        return plan

    def transform_object(self, write_item: WriteItem, object: Any):
        """Stock's, with each plain value's archive made once (``serialize.saved_value``)."""
        if write_item.type == WriteItemType.BYTE_IO:
            return saved_value(object)
        return object

    def lookup_object(self, index: MetadataIndex):
        found = self._slices.get(item_key(index))
        if found is None:
            return super().lookup_object(index)
        base_index, dim, start, length = found
        return super().lookup_object(base_index).narrow(dim, start, length)


def _containing_item(local_items: list[WriteItem], piece: WriteItem) -> WriteItem:
    chunk = piece.tensor_data.chunk
    for item in local_items:
        if item.index.fqn != piece.index.fqn or item.tensor_data is None:
            continue
        base = item.tensor_data.chunk
        if all(
            b <= c and c + n <= b + m
            for b, m, c, n in zip(base.offsets, base.sizes, chunk.offsets, chunk.sizes, strict=True)
        ):
            return item
    raise RuntimeError(
        f"the global plan asks this rank to write {piece.index.fqn} at {tuple(chunk.offsets)}, "
        "which no local tensor covers: the plans were not made by this planner's local step"
    )
