"""hpZ on HSDP meshes: which ``reshard_after_forward`` is node-local, and a (2, 4) run.

Under HSDP the post-forward copy lives on blocks of ``r`` consecutive entries of one
replica's shard group (FSDP builds ``mesh.view(-1, r)``), so ``r`` counts a *shard group's*
ranks per node, not the mesh's. The run: 8 gloo ranks emulating 2 nodes of 4
(``LOCAL_WORLD_SIZE=4``), a (replicate 2, shard 4) mesh laid out with both replicas inside
each node (``[[0, 2, 4, 6], [1, 3, 5, 7]]``): the shard groups span both nodes, 2 ranks on
each, so hpZ is ``r = 2`` and every backward all-gather runs over the 2 ranks of one node.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.device_mesh import DeviceMesh

import fsdp_ext
from fsdp_ext._torch import group_reshard_after_forward, param_group
from fsdp_ext.testing import run_distributed
from fsdp_ext.wrap.node_reshard import node_reshard_for_ranks
from tests.test_comm_weights import Block, Net, _batch
from tests.test_hpz import _Collectives

WORLD, NODE, SHARD = 8, 4, 4
# both replicas of every shard position inside one node; each shard group on both nodes
MESH = [[0, 2, 4, 6], [1, 3, 5, 7]]


def test_node_reshard_counts_a_shard_groups_ranks_per_node():
    flat = [g for row in MESH for g in row]
    # the mesh holds 4 ranks per node, but each shard group only 2: r is 2, not True
    assert node_reshard_for_ranks(flat, NODE, shard_size=SHARD) == 2
    # replicas across nodes (the default layout): each shard group is one node
    assert node_reshard_for_ranks(range(8), 4, shard_size=4) is True
    # the shard dim spans two nodes of 2, replicas on other nodes
    assert node_reshard_for_ranks(range(8), 2, shard_size=4) == 2
    # replicas inside a node and shard groups spanning 2 nodes of 4: [[0,1,4,5],[2,3,6,7]]
    assert node_reshard_for_ranks([0, 1, 4, 5, 2, 3, 6, 7], 4, shard_size=4) == 2
    # 4 replicas of 2 shards, nodes of 4: each shard group in one node
    assert node_reshard_for_ranks([0, 4, 1, 5, 2, 6, 3, 7], 4, shard_size=2) is False
    assert node_reshard_for_ranks([0, 1, 2, 3, 4, 5, 6, 7], 4, shard_size=2) is True
    # shard groups that differ in ranks per node: FSDP takes one r, so refuse
    with pytest.raises(ValueError, match="different numbers of ranks per node"):
        node_reshard_for_ranks([0, 1, 2, 3, 4, 8, 12, 16], 4, shard_size=4)
    # a block of r entries on two nodes
    with pytest.raises(ValueError, match="spans nodes"):
        node_reshard_for_ranks([0, 4, 2, 6, 1, 3, 5, 7], 4, shard_size=4)
    with pytest.raises(ValueError, match="whole shard groups"):
        node_reshard_for_ranks(range(6), 2, shard_size=4)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(
    st.integers(1, 4),  # nodes
    st.sampled_from([(1, 1), (2, 1), (2, 2), (4, 1), (4, 2), (4, 4), (6, 2), (6, 3)]),
    st.randoms(use_true_random=False),
)
def test_hsdp_layouts_get_a_shard_groups_ranks_per_node(nodes, sizes, rnd):
    """Any HSDP mesh whose shard groups take ``q`` adjacent ranks from each of the nodes
    (replicas anywhere: ``node_size / q`` of them inside each node), nodes and ranks in
    any order: ``r`` is ``q`` (True for one node, False for q = 1 on several)."""
    node_size, q = sizes
    replicas = node_size // q
    order = list(range(nodes))
    rnd.shuffle(order)
    picks = {}
    for node in range(nodes):
        members = list(range(node * node_size, (node + 1) * node_size))
        rnd.shuffle(members)
        picks[node] = [members[j * q : (j + 1) * q] for j in range(replicas)]
    mesh = [[g for node in order for g in picks[node][j]] for j in range(replicas)]
    flat = [g for row in mesh for g in row]
    assert sorted(flat) == list(range(nodes * node_size))
    want = True if nodes == 1 else (False if q == 1 else q)
    got = node_reshard_for_ranks(flat, node_size, shard_size=q * nodes)
    assert got == want and type(got) is type(want), (mesh, node_size, got, want)
    # FSDP's post-forward groups (mesh.view(-1, r)): each one node, each inside one replica
    r = {True: q * nodes, False: 1}.get(want, want) if isinstance(want, bool) else want
    for row in mesh:
        for start in range(0, len(row), r):
            assert len({g // node_size for g in row[start : start + r]}) == 1


def _hsdp_rank() -> dict:
    os.environ["LOCAL_WORLD_SIZE"] = str(NODE)  # 2 emulated nodes of 4 ranks
    mesh = DeviceMesh("cpu", torch.tensor(MESH), mesh_dim_names=("replicate", "shard"))
    out: dict = {"node_local": fsdp_ext.node_local_reshard(mesh)}
    rank = dist.get_rank()
    for raf in ("node", True):
        torch.manual_seed(0)
        net = Net()
        fsdp_ext.shard_by_policy(
            net, auto_wrap_policy={Block}, mesh=mesh, reshard_after_forward=raf
        )
        weights = fsdp_ext.register_weight_all_gather(
            net, fsdp_ext.WeightQuantConfig(group_size=32)
        )
        optim = torch.optim.AdamW(net.parameters(), lr=1e-2)
        restore: list = []
        collectives = _Collectives(restore)
        losses = []
        try:
            for step in range(3):
                x, y = _batch(step, rows=2 * WORLD)
                collectives.phase = "forward"
                loss = F.mse_loss(net(x[2 * rank : 2 * rank + 2]), y[2 * rank : 2 * rank + 2])
                collectives.phase = "backward"
                loss.backward()
                collectives.phase = "optimizer"
                optim.step()
                optim.zero_grad()
                losses.append(loss.detach())
        finally:
            for name, original in restore:
                setattr(dist, name, original)
        out[raf] = {
            "losses": torch.stack(losses),
            "reshard": [group_reshard_after_forward(param_group(m)) for m in (net, *net.blocks)],
            "backward_groups": sorted({r for r, _ in collectives.gathers("backward")}),
            "forward_groups": sorted({r for r, _ in collectives.gathers("forward")}),
            "intra_node_gathers": weights.stats.intra_node_gathers,
            "quantized_gathers": weights.stats.quantized_gathers,
        }
    return out


def test_hpz_on_a_2x4_hsdp_mesh_with_replicas_inside_each_node():
    """r = 2 (an int: hpZ on), backward all-gathers over the 2 ranks of the own shard group
    on the own node, and the losses of the non-hpZ run, bit for bit (qwZ on in both: the
    node-local copy holds the forward's dequantised weights, which a quantised backward
    gather of the shards reproduces)."""
    for rank, r in enumerate(run_distributed(_hsdp_rank, WORLD, timeout=300)):
        assert r["node_local"] == 2 and r["node_local"] is not True
        node, replica = rank // NODE, rank % 2
        own_node_pair = (node * NODE + replica, node * NODE + replica + 2)
        shard_group = tuple(MESH[replica])
        hpz, full = r["node"], r[True]
        assert hpz["reshard"] == [2] * 3 and full["reshard"] == [True] * 3  # root included
        assert hpz["forward_groups"] == full["forward_groups"] == [shard_group]
        assert hpz["backward_groups"] == [own_node_pair]
        assert full["backward_groups"] == [shard_group]
        assert hpz["intra_node_gathers"] == 9 and full["intra_node_gathers"] == 0
        assert torch.equal(hpz["losses"], full["losses"]), (rank, hpz["losses"], full["losses"])
