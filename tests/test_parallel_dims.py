"""ParallelDims: degrees validated once; every rank in exactly one group of every view."""

import pytest
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from fsdp_ext import ParallelDims
from fsdp_ext.testing import run_distributed

VIEWS = ["pp", "dp_replicate", "efsdp", "ep", "dp_shard", "edp", "dp"]


@st.composite
def degrees(draw):
    pp, dp_replicate, efsdp, ep = (draw(st.integers(1, 4)) for _ in range(4))
    return {"pp": pp, "dp_replicate": dp_replicate, "dp_shard": efsdp * ep, "ep": ep}


@settings(max_examples=60, deadline=None)
@given(kw=degrees(), infer=st.booleans())
def test_every_rank_in_exactly_one_group_of_each_view(kw, infer):
    world = kw["pp"] * kw["dp_replicate"] * kw["dp_shard"]
    dims = ParallelDims(world, **({**kw, "dp_shard": -1} if infer else kw))
    assert dims.dp_shard == kw["dp_shard"]
    sizes = {
        "pp": dims.pp,
        "dp_replicate": dims.dp_replicate,
        "efsdp": dims.efsdp,
        "ep": dims.ep,
        "dp_shard": dims.dp_shard,
        "edp": dims.dp_replicate * dims.efsdp,
        "dp": dims.dp,
    }
    for name in VIEWS:
        groups = dims.rank_groups(name)
        members = sorted(r for g in groups for r in g)
        assert members == list(range(world)), name  # each rank once
        assert {len(g) for g in groups} == {sizes[name]}, name
    # structure: an ep group and an efsdp group meet in exactly one rank, and a dp group
    # is the union of (efsdp x ep x dp_replicate) for one pipeline stage
    for ep_group in dims.rank_groups("ep"):
        for efsdp_group in dims.rank_groups("efsdp"):
            assert len(set(ep_group) & set(efsdp_group)) <= 1
    for dp_group in dims.rank_groups("dp"):
        edp = [g for g in dims.rank_groups("edp") if set(g) <= set(dp_group)]
        assert sorted(r for g in edp for r in g) == sorted(dp_group)
        assert len(edp) == dims.ep


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"world_size": 4, "dp_shard": 3}, "must equal world_size"),
        ({"world_size": 4, "ep": 3}, "ep=3 must divide dp_shard=4"),
        ({"world_size": 4, "dp_replicate": 3}, "cannot infer dp_shard"),
        ({"world_size": 4, "ep": 0}, "ep must be an int >= 1"),
        ({"world_size": 4, "pp": -2}, "pp must be an int >= 1"),
        ({"world_size": 0}, "world_size must be an int >= 1"),
        ({"world_size": 4, "dp_shard": 0}, "dp_shard must be an int >= 1 or -1"),
        ({"world_size": 4, "dp_shard": 2, "pp": 2, "ep": 4}, "ep=4 must divide dp_shard=2"),
    ],
)
def test_bad_degrees_are_rejected_with_the_argument_named(kwargs, match):
    world = kwargs.pop("world_size")
    with pytest.raises(ValueError, match=match):
        ParallelDims(world, **kwargs)


def test_unknown_view_name():
    with pytest.raises(ValueError, match="name must be one of"):
        ParallelDims(2).rank_groups("tp")


def _mesh_groups(kwargs):
    dims = ParallelDims(dist.get_world_size(), **kwargs)
    dims.build_mesh("cpu")
    views = {name: dist.get_process_group_ranks(dims.view(name).get_group()) for name in VIEWS}
    fsdp = {
        "dp_mesh": [dist.get_process_group_ranks(g) for g in dims.dp_mesh.get_all_groups()],
        "edp_mesh": [dist.get_process_group_ranks(g) for g in dims.edp_mesh.get_all_groups()],
    }
    return views, fsdp


@pytest.mark.parametrize(
    ("world", "kwargs"),
    [
        (4, {"ep": 2}),
        (4, {"dp_replicate": 2, "ep": 2}),
        pytest.param(8, {"pp": 2, "ep": 2}, marks=pytest.mark.slow),  # 8 ranks: 12 s
    ],
    ids=["fsdp-ep2", "hsdp-ep2", "pp2-ep2"],
)
def test_device_mesh_groups_match_the_spec(world, kwargs):
    dims = ParallelDims(world, **kwargs)
    for rank, (views, fsdp) in enumerate(run_distributed(_mesh_groups, world, kwargs)):
        for name in VIEWS:
            expected = next(g for g in dims.rank_groups(name) if rank in g)
            assert views[name] == expected, (rank, name)
        replicate = next(g for g in dims.rank_groups("dp_replicate") if rank in g)
        shard = next(g for g in dims.rank_groups("dp_shard") if rank in g)
        efsdp = next(g for g in dims.rank_groups("efsdp") if rank in g)
        if dims.dp_replicate > 1:
            assert fsdp["dp_mesh"] == [replicate, shard]
            assert fsdp["edp_mesh"] == [replicate, efsdp]
        else:
            assert fsdp["dp_mesh"] == [shard]
            assert fsdp["edp_mesh"] == [efsdp]
