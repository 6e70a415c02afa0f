"""The one wire-byte counter (``fsdp_ext.testing.WireCounter``) on real gloo ranks, against
hand formulas: each collective with known tensor sizes on 2 nodes x 2 ranks (bytes to
peers, to other nodes, by the group's scope, a nested call counted once), and one FSDP2
training step against the model's parameter sizes."""

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

from fsdp_ext.testing import WireCounter, run_distributed
from tests.meshes import cpu_mesh

SPLITS = [1, 2, 3, 4]  # rows of 3 floats (12 bytes) to ranks 0..3


def _collectives():
    me = dist.get_rank()
    pair = dist.new_group([0, 1])
    with WireCounter(node_size=2) as wire, WireCounter(gloo_algorithms=True) as gloo:
        dist.all_gather_into_tensor(torch.empty(4 * 10), torch.ones(10))
        dist.reduce_scatter_tensor(torch.empty(6), torch.ones(24))
        rows = sum(SPLITS)
        dist.all_to_all_single(
            torch.empty(4 * SPLITS[me], 3),
            torch.ones(rows, 3),
            output_split_sizes=[SPLITS[me]] * 4,
            input_split_sizes=SPLITS,
        )
        dist.all_reduce(torch.ones(5))
        dist.broadcast(torch.ones(7), src=1)
        if me < 2:
            dist.all_reduce(torch.ones(8), group=pair)
        wire.paused = True
        dist.all_reduce(torch.ones(1000))
    return dict(
        sent=wire.sent, cross=wire.cross, scope=wire.by_scope, calls=wire.calls, gloo=gloo.sent
    )


def test_each_collective_against_its_hand_formula():
    for me, out in enumerate(run_distributed(_collectives, 4)):
        node = me // 2
        successor_crosses = (me + 1) % 4 // 2 != node  # the ring's next rank
        to_peers = (sum(SPLITS) - SPLITS[me]) * 12
        to_other_node = sum(SPLITS[r] for r in range(4) if r // 2 != node) * 12
        want = {
            "all_gather": 3 * 40,  # (W - 1) b
            "reduce_scatter": 3 * 96 // 4,  # (W - 1) / W b
            "all_to_all": to_peers,
            "all_reduce": 2 * 3 * 20 // 4 + (2 * 1 * 32 // 2 if me < 2 else 0),
            "broadcast": 3 * 28 if me == 1 else 0,
        }
        assert out["sent"] == want, me
        ring_cross = {k: want[k] if successor_crosses else 0 for k in ("all_gather",)}
        assert out["cross"]["all_gather"] == ring_cross["all_gather"]
        assert out["cross"]["reduce_scatter"] == (72 if successor_crosses else 0)
        assert out["cross"]["all_to_all"] == to_other_node
        assert out["cross"]["broadcast"] == (2 * 28 if me == 1 else 0)
        assert out["scope"].get("all_reduce_intra", 0) == (32 if me < 2 else 0)
        assert out["scope"]["all_reduce_inter"] == 30
        # all_gather_into_tensor calls all_gather_single inside: one call, counted once
        assert out["calls"]["all_gather"] == 1 and out["calls"]["all_reduce"] == (
            2 if me < 2 else 1
        )
        # gloo reduces and scatters through a ring all-reduce: twice the bytes
        assert out["gloo"]["reduce_scatter"] == 2 * 3 * 96 // 4


def _fsdp_step():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 7))
    for layer in model:
        fully_shard(layer, mesh=cpu_mesh())
    fully_shard(model, mesh=cpu_mesh())
    with WireCounter() as wire:
        model(torch.randn(4, 16)).sum().backward()
    return wire.sent


def test_an_fsdp_step_against_the_parameter_sizes():
    # W = 2; FSDP pads dim 0 of each parameter to a multiple of W: 16 x 16 + 16 -> 136 per
    # rank; 7 x 16 + 7 -> 8 x 16 / 2 + 8 / 2 = 68 per rank; fp32
    shards = [136 * 4, 68 * 4]
    for sent in run_distributed(_fsdp_step, 2):
        # each unit gathered in forward and again in backward ((W - 1) b each); the root
        # holds no parameter; each gradient reduce-scattered once ((W - 1) / W of W b)
        assert sent["all_gather"] == sum(2 * b for b in shards)
        assert sent["reduce_scatter"] == sum(shards)
        assert set(sent) == {"all_gather", "reduce_scatter"}
