"""SpreadSavePlanner's global step on random plans: exactly-once, balance, LPT, grouping."""

from __future__ import annotations

import copy
import math
from collections import defaultdict

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)

from fsdp_ext._torch import dedup_save_plans
from fsdp_ext.checkpoint.layers import default_layer_key
from fsdp_ext.checkpoint.planner import spread_plans
from fsdp_ext.checkpoint.verify_plan import LOCALITY_SLACK, assign_checks

ELEM = {torch.float32: 4, torch.bfloat16: 2}


def tensor_item(fqn, shape, dtype=torch.float32, offset=None, full=None):
    offset = torch.Size(offset or [0] * len(shape))
    full = torch.Size(full or shape)
    return WriteItem(
        index=MetadataIndex(fqn, offset),
        type=WriteItemType.TENSOR if full == torch.Size(shape) else WriteItemType.SHARD,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=offset, sizes=torch.Size(shape)),
            properties=TensorProperties(dtype=dtype),
            size=full,
        ),
    )


def bytes_item(fqn):
    return WriteItem(index=MetadataIndex(fqn), type=WriteItemType.BYTE_IO)


def nbytes(item):
    if item.tensor_data is None:
        return 0
    return math.prod(item.tensor_data.chunk.sizes) * ELEM[item.tensor_data.properties.dtype]


@st.composite
def plans(draw, pattern=None):
    """World size, a sharded load per rank, replicated items held by full / HSDP / random sets."""
    world = draw(st.integers(1, 16))
    pattern = pattern or draw(st.sampled_from(["full", "hsdp", "random"]))
    per_rank: list[list[WriteItem]] = [[] for _ in range(world)]
    for r in range(world):
        for j in range(draw(st.integers(0, 3))):
            rows = draw(st.integers(1, 64))
            per_rank[r].append(
                tensor_item(
                    f"layers.{j}.w_shard", (rows, 16), offset=(64 * r, 0), full=(64 * world, 16)
                )
            )
    shard = next(
        d for d in range(world, 0, -1) if world % d == 0 and d <= draw(st.integers(1, world))
    )
    n_items = draw(st.integers(1, 24))
    for i in range(n_items):
        layer = draw(st.integers(-1, 5))
        fqn = f"layers.{layer}.p{i}" if layer >= 0 else f"embed{i}"
        shape = (draw(st.integers(1, 400)), draw(st.sampled_from([1, 8, 64])))
        dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
        if pattern == "full":
            hs = list(range(world))
        elif pattern == "hsdp":
            s = draw(st.integers(0, shard - 1))
            hs = [r for r in range(world) if r % shard == s]
        else:
            hs = sorted(draw(st.sets(st.integers(0, world - 1), min_size=1)))
        for r in hs:
            per_rank[r].append(tensor_item(fqn, shape, dtype))
    if draw(st.booleans()):
        for r in range(world):
            per_rank[r].append(bytes_item("step"))
    return [SavePlan(items) for items in per_rank]


def originals(all_plans):
    holders, first = defaultdict(set), {}
    for r, plan in enumerate(all_plans):
        for item in plan.items:
            key = (item.index.fqn, tuple(item.index.offset or ()))
            holders[key].add(r)
            first.setdefault(key, item)
    return holders, first


def check_exactly_once(all_plans, out):
    """Each original item's chunk is covered exactly once by pieces its holders write."""
    holders, first = originals(all_plans)
    counts = {
        k: torch.zeros(tuple(o.tensor_data.chunk.sizes), dtype=torch.int32)
        for k, o in first.items()
        if o.tensor_data is not None
    }
    bytes_items = defaultdict(list)
    for rank, plan in enumerate(out):
        for item in plan.items:
            if item.tensor_data is None:
                bytes_items[item.index.fqn].append(rank)
                continue
            chunk = item.tensor_data.chunk
            owners = []
            for key, orig in first.items():
                base = orig.tensor_data.chunk if orig.tensor_data is not None else None
                if key[0] != item.index.fqn or base is None:
                    continue
                if all(
                    b <= c and c + n <= b + m
                    for b, m, c, n in zip(
                        base.offsets, base.sizes, chunk.offsets, chunk.sizes, strict=True
                    )
                ):
                    owners.append(key)
            assert len(owners) == 1, item
            assert rank in holders[owners[0]], (item, rank)
            base = first[owners[0]].tensor_data.chunk
            view = counts[owners[0]]
            for d, (b, c, n) in enumerate(
                zip(base.offsets, chunk.offsets, chunk.sizes, strict=True)
            ):
                view = view.narrow(d, c - b, n)
            view += 1
    assert all(bool((c == 1).all()) for c in counts.values())
    byte_keys = {k[0] for k, o in first.items() if o.tensor_data is None}
    assert {k: len(v) for k, v in bytes_items.items()} == dict.fromkeys(byte_keys, 1)
    total_in = sum(nbytes(first[k]) for k in first)
    total_out = sum(nbytes(i) for p in out for i in p.items)
    assert total_in == total_out


def loads(out):
    return [sum(nbytes(i) for i in p.items) for p in out]


def sharded_loads(all_plans):
    holders, _ = originals(all_plans)
    return [
        sum(
            nbytes(i)
            for i in p.items
            if len(holders[(i.index.fqn, tuple(i.index.offset or ()))]) == 1
        )
        for p in all_plans
    ]


SETTINGS = settings(
    max_examples=80, deadline=None, suppress_health_check=[HealthCheck.filter_too_much]
)


@SETTINGS
@given(plans(), st.booleans())
def test_every_byte_written_exactly_once(all_plans, split):
    check_exactly_once(all_plans, spread_plans(all_plans, split_replicated=split))


@SETTINGS
@given(plans("full"))
def test_balance_within_five_percent_when_replicated_bytes_can_level(all_plans):
    """max/mean <= 1.05 once replicated bytes can fill every rank up to the busiest shard.

    The issue's condition (replicated >= 4 x largest sharded load) is exactly enough for
    world <= 5; above that the gaps to fill add up to (world - 1) x the largest shard, so
    the condition scales: replicated >= max(4, world - 1) x largest sharded load. Rows
    (the unit of a split) must be small next to the fair share.
    """
    world = len(all_plans)
    sharded = sharded_loads(all_plans)
    total = sum(loads(dedup_save_plans(all_plans)))
    replicated = total - sum(sharded)
    assume(replicated >= max(4, world - 1) * max(sharded))
    _, first = originals(all_plans)
    row = max(nbytes(i) / i.tensor_data.chunk.sizes[0] for i in first.values() if i.tensor_data)
    assume(row <= 0.02 * total / world)
    got = loads(spread_plans(all_plans))
    assert max(got) / (total / world) <= 1.05, got


@SETTINGS
@given(plans("full"))
def test_lpt_bound_without_splitting(all_plans):
    """Whole groups, largest first to the least loaded: max <= max(S_max, mean + (1-1/W) p_max)."""
    world = len(all_plans)
    out = spread_plans(all_plans, split_replicated=False)
    holders, first = originals(all_plans)
    groups = defaultdict(int)
    for key, item in first.items():
        if len(holders[key]) > 1:
            layer = default_layer_key(key[0])
            groups[layer if layer is not None else key] += nbytes(item)
    total = sum(nbytes(i) for i in first.values())
    bound = max(
        max(sharded_loads(all_plans)),
        total / world + (1 - 1 / world) * max(groups.values(), default=0),
    )
    assert max(loads(out)) <= bound + 1e-6
    # LPT with busy-from-the-start machines is within 3/2 of optimal (Lee 1991); any lower
    # bound on the optimum works here: the mean, the busiest shard, the biggest group on
    # the idlest rank.
    sharded = sharded_loads(all_plans)
    lower = max(total / world, max(sharded), min(sharded) + max(groups.values(), default=0))
    assert max(loads(out)) <= 1.5 * lower + 1e-6
    # nothing is split
    assert sum(len(p.items) for p in out) == len(first)
    # and the loads are exactly those of textbook LPT: groups largest first, each onto the
    # least-loaded rank (lowest index on ties), starting from the sharded loads
    reference = list(sharded)
    for size in sorted(groups.values(), reverse=True):
        reference[min(range(world), key=lambda r: (reference[r], r))] += size
    assert loads(out) == reference


@SETTINGS
@given(plans())
def test_layer_groups_stay_on_one_rank_without_splitting(all_plans):
    holders, _ = originals(all_plans)
    out = spread_plans(all_plans, split_replicated=False)
    where = defaultdict(set)
    for rank, plan in enumerate(out):
        for item in plan.items:
            key = (item.index.fqn, tuple(item.index.offset or ()))
            layer = default_layer_key(item.index.fqn)
            if len(holders[key]) > 1 and layer is not None:
                where[(layer, tuple(sorted(holders[key])))].add(rank)
    assert all(len(ranks) == 1 for ranks in where.values()), where


@SETTINGS
@given(plans(), st.booleans())
def test_plan_is_deterministic_and_pure(all_plans, split):
    before = copy.deepcopy(all_plans)
    a = spread_plans(all_plans, split_replicated=split)
    b = spread_plans(copy.deepcopy(all_plans), split_replicated=split)
    assert a == b
    assert all_plans == before


def test_big_tensor_is_split_and_stock_is_not():
    """One 100-row replicated matrix over 4 ranks: ours writes 25 rows each, stock one rank 100."""
    all_plans = [SavePlan([tensor_item("embed.weight", (100, 8))]) for _ in range(4)]
    assert loads(spread_plans(all_plans)) == [800] * 4
    assert sorted(loads(dedup_save_plans(all_plans))) == [0, 0, 0, 3200]
    assert loads(spread_plans(all_plans, split_replicated=False)) == [3200, 0, 0, 0]


def test_coarse_dim0_splits_along_the_next_dim():
    """Fused experts [8, 512, 64] over 32 ranks: 8 dim-0 slices cannot balance 32 ranks."""
    all_plans = [SavePlan([tensor_item("layers.0.experts.w1", (8, 512, 64))]) for _ in range(32)]
    out = spread_plans(all_plans)
    check_exactly_once(all_plans, out)
    assert loads(out) == [8 * 512 * 64 * 4 // 32] * 32
    assert {tuple(i.tensor_data.chunk.sizes) for p in out for i in p.items} == {(8, 16, 64)}


def test_bad_arguments():
    with pytest.raises(ValueError, match="slack"):
        spread_plans([SavePlan([])], slack=-1)


# -- who checks which file on a load -------------------------------------------------------


@st.composite
def load_reads(draw):
    """Files (size, writer) and, per rank, the files it reads: everything, own files, or
    random subsets."""
    world = draw(st.integers(1, 12))
    n_files = draw(st.integers(1, 30))
    sizes = {f"f{i}": draw(st.integers(1, 10_000)) for i in range(n_files)}
    writers = {name: draw(st.integers(0, world - 1)) for name in sizes}
    pattern = draw(st.sampled_from(["all", "own", "random"]))
    if pattern == "all":
        reads = [dict(sizes) for _ in range(world)]
    elif pattern == "own":
        reads = [{f: s for f, s in sizes.items() if writers[f] == r} for r in range(world)]
    else:
        reads = [{f: s for f, s in sizes.items() if draw(st.booleans())} for _ in range(world)]
    return reads, sizes, writers, pattern


@SETTINGS
@given(load_reads())
def test_every_file_read_is_checked_once_by_one_of_its_readers(case):
    reads, sizes, writers, pattern = case
    checks = assign_checks(reads, sizes, writers)
    read_by = {f for r in reads for f in r}
    assert sorted(f for c in checks for f in c) == sorted(read_by)  # once each
    assert all(f in reads[r] for r, c in enumerate(checks) for f in c)  # by a reader
    if pattern == "own":  # a load into the layout it was saved from: its own files
        assert all(writers[f] == r for r, c in enumerate(checks) for f in c)
    if pattern == "all":  # checking divided: LPT's bound, plus the locality slack
        load = [sum(sizes[f] for f in c) for c in checks]
        total, world = sum(sizes.values()), len(reads)
        assert max(load) <= total / world + (1 + LOCALITY_SLACK) * max(sizes.values())
    assert assign_checks(reads, sizes, writers) == checks  # deterministic


def test_a_reader_checks_its_own_files_when_the_balance_allows():
    """Everyone reads every file (a replicated load): each file is checked by the rank that
    wrote it, which needed its bytes whole anyway; a writer of too much gives some away."""
    sizes = {f"f{i}": 100 for i in range(8)}
    writers = {f"f{i}": 3 - i % 4 for i in range(8)}
    checks = assign_checks([dict(sizes)] * 4, sizes, writers)
    assert all(writers[f] == r for r, c in enumerate(checks) for f in c)
    lopsided = dict.fromkeys(sizes, 0)  # rank 0 wrote everything
    checks = assign_checks([dict(sizes)] * 4, sizes, lopsided)
    assert [len(c) for c in checks] == [2, 2, 2, 2]
