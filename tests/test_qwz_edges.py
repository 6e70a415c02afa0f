"""qwZ's edges, on 2 gloo ranks against references built without qwZ.

- A unit holding a non-float parameter (an int64 tensor registered as a parameter with
  ``requires_grad=False``) beside float ones: FSDP gathers that unit as bytes. Its float
  parameters are still sent as int8 codes (the payload at the collective is the codec's
  plus the int parameter's raw bytes) and come out as the hand-quantised weights; the int
  parameter comes out exact.
- ``backward=False`` on the root unit, which keeps its gathered weights from forward into
  backward: its gradients are those of the stock all-gather, bit for bit (backward computes
  with full-precision weights), not those of ``backward=True``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import fsdp_ext
from fsdp_ext.comm.registry import make_codec
from fsdp_ext.testing import run_distributed
from tests.test_comm_weights import Net, _batch, _shard, quantized_copy
from tests.test_hpz import _Collectives

WORLD, GROUP = 2, 32
# torch 2.11's FSDP2 makes every sharded parameter require grad, so it cannot shard an int
# one ("only Tensors of floating point dtype can require gradients"); 2.13 can
SHARDS_NON_FLOAT = torch.torch_version.TorchVersion(torch.__version__) >= "2.13"
STEPS = torch.arange(7, dtype=torch.int64)  # 7 rows: padded to 8 on 2 ranks


def _with_int_param(net: Net) -> Net:
    net.blocks[0].steps = nn.Parameter(STEPS.clone(), requires_grad=False)
    return net


def _edges_rank() -> dict:
    mesh = init_device_mesh("cpu", (WORLD,))
    rank = dist.get_rank()
    x, y = _batch(0)
    x, y = x[4 * rank : 4 * rank + 4], y[4 * rank : 4 * rank + 4]
    return {
        "int": _int_param_phase(mesh, x, y) if SHARDS_NON_FLOAT else None,
        "root": _root_phase(mesh, x, y),
    }


def _int_param_phase(mesh, x, y) -> dict:
    """An int parameter in blocks.0: the weights forward sees, the forward gathers' bytes."""
    torch.manual_seed(0)
    net = _with_int_param(Net())
    _shard(net, mesh)
    handle = fsdp_ext.register_weight_all_gather(net, fsdp_ext.WeightQuantConfig(group_size=GROUP))
    seen = {}
    block = net.blocks[0]
    block.register_forward_pre_hook(  # after FSDP's own pre-forward: the gathered weights
        lambda mod, _i: seen.update(up=mod.up.weight.detach().clone(), steps=mod.steps.clone())
    )
    restore: list = []
    collectives = _Collectives(restore)
    try:
        F.mse_loss(net(x), y).backward()
    finally:
        for name, original in restore:
            setattr(dist, name, original)
    return {
        "seen": seen,
        "gathers": collectives.gathers("forward"),
        "stats": handle.stats,
        "wire": handle.wire_choices["blocks.0"],
    }


def _root_phase(mesh, x, y) -> dict:
    """backward=False on the root unit (no sub-units): grads of the stock gather."""
    grads = {}
    for name, config in [
        ("stock", None),
        ("forward_only", fsdp_ext.WeightQuantConfig(group_size=GROUP, backward=False)),
        ("both", fsdp_ext.WeightQuantConfig(group_size=GROUP)),
    ]:
        torch.manual_seed(0)
        net = Net()
        fully_shard(net, mesh=mesh)
        weights = None if config is None else fsdp_ext.register_weight_all_gather(net, config)
        F.mse_loss(net(x), y).backward()
        grads[name] = {n: p.grad.to_local().clone() for n, p in net.named_parameters()}
        if weights is not None:
            grads[name + "_stats"] = weights.stats
    return grads


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return run_distributed(_edges_rank, WORLD, timeout=300)


def _block0_segments(net: Net) -> list[int]:
    """Each float parameter's padded shard in blocks.0 (elements), in module order."""
    return [
        -(-p.shape[0] // WORLD) * p[0].numel()
        for n, p in net.blocks[0].named_parameters()
        if p.is_floating_point()
    ]


@pytest.mark.skipif(not SHARDS_NON_FLOAT, reason="torch 2.11's FSDP2 shards float parameters only")
def test_a_non_float_parameter_leaves_its_units_float_weights_quantized(runs):
    torch.manual_seed(0)
    net = Net()
    want = quantized_copy(net, WORLD, GROUP)["blocks.0.up.weight"]
    codec = make_codec(fsdp_ext.WeightQuantConfig(group_size=GROUP))
    segments = _block0_segments(net)
    raw = -(-len(STEPS) // WORLD) * STEPS.element_size()  # the int rows travel as bytes
    payload = codec.unit_payload_bytes(segments) + raw
    plain = sum(segments) * 4 + raw
    for r in runs:
        got = r["int"]
        assert torch.equal(got["seen"]["up"], want)  # the hand-quantised weights
        assert torch.equal(got["seen"]["steps"], STEPS)  # the int parameter, exact
        # forward gathers: root, blocks.0 (bytes: codec payload + raw int rows), blocks.1
        assert got["gathers"][1] == ((0, 1), payload)
        assert got["wire"].compressed and got["wire"].payload_bytes == payload
        assert got["wire"].plain_bytes == plain
        # every gather of the step quantised: 3 in forward, 2 in backward
        assert got["stats"].quantized_gathers == 5 and got["stats"].full_precision_gathers == 0


def test_backward_false_gives_the_root_full_precision_gradients(runs):
    for r in runs:
        root = r["root"]
        for name, grad in root["stock"].items():
            assert torch.equal(root["forward_only"][name], grad), name
        assert any(not torch.equal(root["both"][n], g) for n, g in root["stock"].items())
        # the root's one gather serves both passes: full precision when backward=False
        assert root["forward_only_stats"].full_precision_gathers == 1
        assert root["forward_only_stats"].quantized_gathers == 0
        assert root["both_stats"].quantized_gathers == 1
