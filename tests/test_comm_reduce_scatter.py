"""LoCoReduceScatter on real gloo ranks against the exact reduce-scatter of the same input."""

import pytest
import torch
import torch.distributed as dist

from fsdp_ext import LoCoConfig, LoCoReduceScatter, Q4Config
from fsdp_ext.kernels.dequantize_reduce import dequantize_reduce_reference
from fsdp_ext.kernels.quantize_ef import quantize_ef_reference
from fsdp_ext.testing import run_distributed

OPS = {
    "avg": lambda: dist.ReduceOp.AVG,
    "sum": lambda: dist.ReduceOp.SUM,
    "premul_sum": lambda: dist._make_nccl_premul_sum(0.25),  # how FSDP2 makes it
}
OP_SCALE = {"avg": None, "sum": 1.0, "premul_sum": 0.25}
SHARDS = [256, 100, 37]  # a multiple of group_size, a padded one, one smaller than a group
GROUP = 128
_stock_reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


def _inputs(world, shard, dtype, seed):
    """Every rank's reduce-scatter input, with a different scale per rank and an outlier."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(world, world * shard, generator=gen)
    x *= torch.logspace(-1, 1, world).view(-1, 1)
    x[0, 3] = 50.0
    return x.to(dtype)


def _bound(inputs, world, shard, bits, scale):
    """Sum over senders of scale_g / 2 for each element of each destination chunk."""
    q_max = 7 if bits == 4 else 127
    padded = -(-shard // GROUP) * GROUP
    chunks = torch.zeros(world, world, padded)
    chunks[..., :shard] = inputs.float().view(world, world, shard)
    absmax = chunks.view(world, world, -1, GROUP).abs().amax(-1, keepdim=True)
    half_steps = (absmax / q_max / 2).expand(-1, -1, -1, GROUP).reshape(world, world, padded)
    return half_steps.sum(0)[:, :shard] * abs(scale)


def _reduce_scatter_cases(world):
    rank = dist.get_rank()
    results = []
    for seed, (op_name, dtype, shard, bits) in enumerate(
        (o, d, s, b)
        for o in OPS
        for d in (torch.float32, torch.bfloat16)
        for s in SHARDS
        for b in (4, 8)
    ):
        inputs = _inputs(world, shard, dtype, seed)
        comm = LoCoReduceScatter(LoCoConfig(bits=bits, group_size=GROUP))
        out = torch.empty(shard, dtype=dtype)
        comm(
            output_tensor=out,
            input_tensor=inputs[rank].clone(),
            group=dist.group.WORLD,
            op=OPS[op_name](),
        )
        # the stock collective on the same input (gloo has no PREMUL_SUM: SUM, then scale)
        stock = torch.empty(shard, dtype=dtype)
        stock_op = dist.ReduceOp.AVG if op_name == "avg" else dist.ReduceOp.SUM
        _stock_reduce_scatter(stock, inputs[rank].clone(), op=stock_op)
        scale = OP_SCALE[op_name] or 1 / world
        if op_name == "premul_sum":
            stock = stock * scale
        exact = inputs.float().sum(0).view(world, shard)[rank] * scale
        bound = _bound(inputs, world, shard, bits, scale)[rank]
        results.append(
            dict(
                case=(op_name, str(dtype), shard, bits),
                out=out.float(),
                stock=stock.float(),
                exact=exact,
                bound=bound,
            )
        )
    return results


@pytest.mark.parametrize("world", [2, 4])
def test_reduce_scatter_within_quantization_bound(world):
    per_rank = run_distributed(_reduce_scatter_cases, world, world)
    worst = {}
    for results in per_rank:
        for r in results:
            op_name, dtype, shard, bits = r["case"]
            # on top of the codec bound: the stock collective's own rounding in its dtype, and
            # the rounding of our output to the reduce dtype
            out_rounding = r["exact"].abs() * (2**-8 if "bfloat16" in dtype else 2**-20)
            slack = (r["stock"] - r["exact"]).abs() + out_rounding + 1e-6
            err = (r["out"] - r["stock"]).abs()
            assert bool((err <= r["bound"] + slack).all()), (
                r["case"],
                float((err - r["bound"]).max()),
            )
            assert torch.isfinite(r["out"]).all()
            rel = float(err.max() / r["exact"].abs().max())
            worst[(op_name, dtype, shard, bits)] = max(
                worst.get((op_name, dtype, shard, bits), 0), rel
            )
    for (op_name, dtype, shard, bits), rel in worst.items():
        if bits == 8:
            # 8 bits: tighter still, by much more than the bf16 output rounding
            rel4 = worst[(op_name, dtype, shard, 4)]
            assert rel < rel4 / 4, (op_name, dtype, shard, rel, rel4)


def _constant_gradient(steps, error_feedback):
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(7)
    grads = torch.randn(2, 2 * 256, generator=gen)
    cfg = LoCoConfig(err_beta=0.0, error_dtype=torch.float32) if error_feedback else Q4Config()
    comm = LoCoReduceScatter(cfg)
    total = torch.zeros(256, dtype=torch.float64)
    errors = {}
    for t in range(1, steps + 1):
        out = torch.empty(256)
        comm(
            output_tensor=out,
            input_tensor=grads[rank].clone(),
            group=dist.group.WORLD,
            op=dist.ReduceOp.AVG,
        )
        total += out.double()
        if t in (1, 8, 32, 128):
            exact = grads.double().sum(0).view(2, 256)[rank] / 2
            errors[t] = float((total / t - exact).abs().max())
    return errors


def test_error_feedback_removes_bias():
    """Same gradient every step, beta = 0: LoCo's running mean converges as C/T,
    plain 4-bit keeps a fixed bias."""
    loco = run_distributed(_constant_gradient, 2, 128, True)
    plain = run_distributed(_constant_gradient, 2, 128, False)
    for rank in range(2):
        e = loco[rank]
        c = e[1]  # C: the one-step error already bounds |e_0 - e_T| summed over senders
        for t in (8, 32, 128):
            assert e[t] <= 2 * c / t, (t, e[t], c)
        p = plain[rank]
        assert p[128] == pytest.approx(p[1], rel=1e-6) and p[128] > 0  # bias does not decay
        assert e[128] < p[128] / 20


def _non_finite_then_finite():
    rank = dist.get_rank()
    grads = torch.randn(2, 2 * 256, generator=torch.Generator().manual_seed(3))
    bad = grads.clone()
    bad[1, 256 + 5] = float("nan")  # rank 1 -> chunk of rank 1, group 0
    bad[1, 130] = float("inf")  # rank 1 -> chunk of rank 0, group 1
    comm = LoCoReduceScatter(LoCoConfig(err_beta=0.5, error_dtype=torch.float32))
    outs = []
    for x in (grads, bad, grads):
        out = torch.empty(256)
        comm(
            output_tensor=out,
            input_tensor=x[rank].clone(),
            group=dist.group.WORLD,
            op=dist.ReduceOp.AVG,
        )
        outs.append(out)
        if x is bad:
            error_after_bad = comm.feedback.error.clone()
    return outs, error_after_bad


def test_non_finite_gradient_reaches_output_and_resets_error():
    (outs0, _), (outs1, err1) = run_distributed(_non_finite_then_finite, 2)
    # rank 0 owns elements [0, 256): the Inf sat at 130 -> its group [128, 256)
    assert not torch.isfinite(outs0[1][130])
    assert not torch.isfinite(outs0[1][128:256]).any() and torch.isfinite(outs0[1][:128]).all()
    # rank 1 owns [256, 512): the NaN sat at 256 + 5 -> its group [0, 128) of rank 1's chunk
    assert torch.isnan(outs1[1][5])
    assert not torch.isfinite(outs1[1][:128]).any() and torch.isfinite(outs1[1][128:]).all()
    # the sender's error entries of both poisoned groups were reset ...
    assert bool((err1[128:256] == 0).all()) and bool((err1[256:384] == 0).all())
    assert bool((err1[:128] != 0).any())  # ... and only those
    # ... so the next finite step is clean and close to the exact mean
    exact = torch.randn(2, 512, generator=torch.Generator().manual_seed(3)).sum(0) / 2
    for rank, outs in enumerate((outs0, outs1)):
        assert torch.isfinite(outs[2]).all()
        assert (outs[2] - exact.view(2, 256)[rank]).abs().max() < 0.5


def _hierarchical(bits):
    rank = dist.get_rank()
    world, k, shard = 4, 2, 100
    inputs = _inputs(world, shard, torch.float32, seed=11)
    comm = LoCoReduceScatter(LoCoConfig(bits=bits, error_dtype=torch.float32), node_size=k)
    outs = []
    for _ in range(2):  # the second call also checks the error feedback across nodes
        out = torch.empty(shard)
        comm(
            output_tensor=out,
            input_tensor=inputs[rank].clone(),
            group=dist.group.WORLD,
            op=dist.ReduceOp.AVG,
        )
        outs.append(out)
    return outs, comm.stats


def _simulate_hierarchical(inputs, bits, rank, steps):
    """Single-process model of 2 x 2: exact node sums, then the 4-bit exchange across nodes."""
    world, k, shard, nodes = 4, 2, 100, 2
    node, local = divmod(rank, k)
    padded = 128
    # sender on node n, local index `local`, holds the node sum of chunks n' * k + local
    errors = {n: torch.zeros(nodes * padded) for n in range(nodes)}
    outs, bounds = [], []
    for _ in range(steps):
        packed, scales = [], []
        for n in range(nodes):
            node_sum = inputs[n * k : (n + 1) * k].sum(0).view(world, shard)[local::k]
            x = torch.zeros(nodes, padded)
            x[:, :shard] = node_sum
            p, s = quantize_ef_reference(
                x.view(-1), errors[n], group_size=GROUP, bits=bits, beta=0.8
            )
            packed.append(p.view(nodes, -1)[node])
            scales.append(s.view(nodes, -1)[node])
        out = dequantize_reduce_reference(
            torch.stack(packed),
            torch.stack(scales),
            group_size=GROUP,
            bits=bits,
            out_scale=1 / world,
        )
        outs.append(out[:shard])
        half_steps = torch.stack(scales).sum(0) / 2 / world
        bounds.append(half_steps.repeat_interleave(GROUP)[:shard])
    return outs, bounds


@pytest.mark.parametrize("bits", [4, 8])
def test_hierarchical_two_by_two(bits):
    per_rank = run_distributed(_hierarchical, 4, bits)
    inputs = _inputs(4, 100, torch.float32, seed=11)
    exact = inputs.sum(0).view(4, 100) / 4
    for rank, (outs, stats) in enumerate(per_rank):
        expected, bounds = _simulate_hierarchical(inputs, bits, rank, steps=2)
        for out, want in zip(outs, expected, strict=True):
            assert torch.equal(out, want)  # intra-node sums of two are exact and commutative
        # first call (no error yet): within half a step per sending node of the exact mean
        assert bool(((outs[0] - exact[rank]).abs() <= bounds[0] * (1 + 2**-20) + 1e-6).all())
        # two calls; only the cross-node exchange is quantised: per call one 128-group
        # payload (codes + fp32 scale) to the one other node ...
        assert stats.bytes_sent == 2 * (128 * bits // 8 + 4)
        # ... while the node peer gets, in fp32, the 2 chunks of 100 it reduces
        assert stats.intra_node_bytes == 2 * (2 * 100 * 4)
