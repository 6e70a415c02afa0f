"""GPU-efficient by construction, checked on CPU: during a training step with qwZ and LoCo
on 2 gloo ranks (the Triton kernels through the interpreter, on the library's real data
path), each unit's gather takes one launch each way whatever its parameter count, each
reduce-scatter one launch each way, and nothing on the hooked path makes the host wait
for the device. Also: the hierarchical path's index tensors are built once, not per step.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import fsdp_ext
from fsdp_ext.comm.hierarchical import NodeGroups, node_local_reduce_scatter
from fsdp_ext.kernels.backend import use_backend
from fsdp_ext.testing import HostSyncs, KernelLaunches, run_distributed

pytestmark = [
    pytest.mark.usefixtures("triton_interpreter"),
    pytest.mark.filterwarnings("ignore:invalid value encountered"),
]


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(64)
        self.up = nn.Linear(64, 128)
        self.down = nn.Linear(128, 64)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(64, 8)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _counted_step() -> dict:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    net = Net()
    fsdp_ext.shard_by_policy(net, auto_wrap_policy={Block}, mesh=mesh)
    config = fsdp_ext.CommConfig(
        gradients=fsdp_ext.LoCoConfig(group_size=32),
        weights=fsdp_ext.WeightQuantConfig(group_size=64),
    )
    handle = fsdp_ext.comm.enable(net, config)
    optim = torch.optim.SGD(net.parameters(), lr=1e-2)
    x, y = torch.randn(4, 64), torch.randn(4, 8)

    def step():
        F.mse_loss(net(x), y).backward()
        optim.step()
        optim.zero_grad()

    with use_backend("triton"):
        step()  # first step: FSDP's lazy init, the error buffers, the tile tables
        handle.reset_stats()
        handle.weights.reset_stats()
        with KernelLaunches() as launches, HostSyncs() as syncs:
            step()
    return {
        "launches": dict(launches.counts),
        "syncs": dict(syncs.counts),
        "where": syncs.where,
        "gathers": handle.weights.stats.quantized_gathers,
        "reductions": handle.stats.reductions,
    }


def test_one_launch_per_unit_and_no_host_sync_in_a_training_step():
    for r in run_distributed(_counted_step, 2, timeout=600):
        # 3 units (2 blocks of 6 parameters, the root's 2): forward gathers all 3, backward
        # the 2 blocks again (the root stays unsharded); each unit reduces once. Before,
        # a gather launched each kernel once per parameter: 14 + 12 = 26 each way.
        assert (r["gathers"], r["reductions"]) == (5, 3), r
        assert r["launches"] == {
            "_quantize_blockwise_kernel": 5,
            "_dequantize_blockwise_kernel": 5,
            "_quantize_ef_kernel": 3,
            "_dequantize_reduce_kernel": 3,
        }, r["launches"]
        assert r["syncs"] == {}, r["where"]


def test_host_sync_counter_sees_what_a_gpu_would_wait_on():
    """The counter itself can fail: each kind of sync is recorded, and where it happened."""
    t = torch.arange(6.0)
    with HostSyncs() as syncs:
        t.sum().item()
        t.tolist()
        bool(t[1] > 0)
        torch.nonzero(t)
        torch.tensor([1, 2], device=t.device)
        torch.repeat_interleave(torch.tensor([1, 2]))
        t + 1  # not a sync
    assert syncs.counts["item"] == 1 and syncs.counts["tolist"] == 1
    assert syncs.counts["bool"] == 1 and syncs.counts["aten.nonzero"] == 1
    assert syncs.counts["tensor(device=)"] == 1 and syncs.counts["aten.repeat_interleave"] == 1
    assert syncs.counts["aten._local_scalar_dense"] == 2  # item and bool


def test_hierarchical_index_tensors_are_built_once():
    """A shard group whose ranks are not in node order (node 1's rank first) reorders its
    chunks by index every reduction; the index tensor is built on the first and reused, so
    later reductions copy nothing from the host."""
    groups = NodeGroups(None, None, node_size=1, num_nodes=2, order=(1, 0))
    x = torch.arange(8.0)
    counts = []
    for _ in range(3):
        with HostSyncs() as syncs:
            rows, sent = node_local_reduce_scatter(x, groups)
        counts.append(syncs.total)
        assert torch.equal(rows, torch.stack([x[4:], x[:4]])) and sent == 0
    assert counts == [1, 0, 0], counts
