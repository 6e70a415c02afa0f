"""LoCo inside real FSDP2 backward passes: every op FSDP sends, reduce dtypes, registration."""

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from fsdp_ext import LoCoConfig, LoCoReduceScatter
from fsdp_ext.comm.reduce_scatter import reduce_op_scale
from fsdp_ext.testing import run_distributed
from tests.meshes import cpu_mesh

_stock_reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


class RecordingLoCo(LoCoReduceScatter):
    """LoCo that also runs the stock reduce-scatter on the same FSDP-given input."""

    def __init__(self, config):
        super().__init__(config)
        self.records = []

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        stock = torch.empty_like(output_tensor)
        _stock_reduce_scatter(stock, input_tensor.clone(), op=dist.ReduceOp.SUM, group=group)
        scale = reduce_op_scale(op, group.size())
        w, g = group.size(), self.config.group_size
        shard = output_tensor.numel()
        padded = -(-shard // g) * g
        chunks = input_tensor.float().new_zeros(w, padded)
        chunks[:, :shard] = input_tensor.float().view(w, shard)
        absmax = chunks.view(w, -1, g).abs().amax(-1)  # this rank's groups, all destinations
        mine = torch.empty_like(absmax)
        dist.all_to_all_single(mine, absmax.contiguous(), group=group)  # senders' scales for me
        q_max = 7 if self.config.bits == 4 else 127
        bound = (mine / q_max / 2).sum(0).repeat_interleave(g)[:shard] * abs(scale)
        super().__call__(output_tensor, input_tensor, group, op, async_op)
        exact = stock.float() * scale
        err = (output_tensor.float() - exact).abs()
        slack = exact.abs() * (2**-7 if output_tensor.dtype == torch.bfloat16 else 2**-20) + 1e-7
        self.records.append(
            dict(
                op=str(getattr(op, "op", op)),
                dtype=output_tensor.dtype,
                within=bool((err <= bound + slack).all()),
                shard=shard,
            )
        )


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 70), nn.ReLU(), nn.Linear(70, 33))


def _data(rank):
    gen = torch.Generator().manual_seed(100 + rank)
    return torch.randn(8, 16, generator=gen), torch.randn(8, 33, generator=gen)


def _reference_grads(world, divide):
    model = _model()
    for rank in range(world):
        x, y = _data(rank)
        nn.functional.mse_loss(model(x), y).backward()
    return [p.grad / divide for p in model.parameters()]


def _fsdp_case(case):
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _model()
    reduce_dtype = torch.bfloat16 if case == "bf16" else torch.float32
    mp = MixedPrecisionPolicy(reduce_dtype=reduce_dtype)
    for layer in (model[0], model[2]):
        fully_shard(layer, mp_policy=mp, mesh=cpu_mesh())
    fully_shard(model, mp_policy=mp, mesh=cpu_mesh())
    comms = []
    for layer in (model[0], model[2]):
        comm = RecordingLoCo(LoCoConfig(group_size=32))
        layer.set_custom_reduce_scatter(comm)
        comms.append(comm)
        if case == "divide_factor":
            layer.set_gradient_divide_factor(3.0)
        if case == "force_sum":
            layer.set_force_sum_reduction_for_comms(True)
    x, y = _data(rank)
    nn.functional.mse_loss(model(x), y).backward()
    grads = [p.grad.full_tensor() for p in model.parameters()]
    # the stored gradient is sum / factor: world by default, 3 when set
    ref = _reference_grads(world, 3.0 if case == "divide_factor" else world)
    rel = max(float((g - r).norm() / r.norm()) for g, r in zip(grads, ref, strict=True))
    return [r for c in comms for r in c.records], rel


@pytest.mark.parametrize(
    ("case", "expected_op"),
    [("default", "AVG"), ("divide_factor", "PREMUL_SUM"), ("force_sum", "SUM"), ("bf16", "AVG")],
)
def test_every_fsdp_op_and_reduce_dtype(case, expected_op):
    for records, rel in run_distributed(_fsdp_case, 2, case):
        assert len(records) == 2  # one reduction per unit holding parameters
        for r in records:
            assert expected_op in r["op"]
            assert r["dtype"] == (torch.bfloat16 if case == "bf16" else torch.float32)
            assert r["within"], r
        assert {r["shard"] for r in records} == {35 * 16 + 35, 17 * 70 + 17}  # padded rows
        # the gradient FSDP stores (after its own pre/post division) is the exact one, up to
        # 4-bit quantisation noise
        assert rel < 0.25, rel
