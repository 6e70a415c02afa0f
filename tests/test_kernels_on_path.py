"""The Triton kernels on the library's real data path (interpreter on CPU), against the
torch reference path: LoCoReduceScatter (flat and hierarchical), the HSDP all-reduce hook,
and the expert-parallel dispatch, all bit for bit. Also counts the passes over
gradient-sized memory that one LoCo reduce-scatter makes outside the kernels and collectives.

With CUDA present, the flat LoCoReduceScatter also runs the real kernels on CUDA tensors
(both ranks on device 0, gloo moving the payload), against the reference path run on CPU.
"""

import dataclasses
import itertools
import sys

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from fsdp_ext import CommConfig, LoCoConfig, LoCoReduceScatter, enable
from fsdp_ext.kernels.backend import use_backend
from fsdp_ext.testing import run_distributed

pytestmark = [pytest.mark.filterwarnings("ignore:invalid value encountered")]
BACKENDS = ("reference", "triton")
# (bits, error dtype, gradient dtype, shard): padded and unpadded shards, every error kind
FLAT_CASES = [
    (4, torch.int8, torch.float32, 100),
    (8, torch.bfloat16, torch.bfloat16, 256),
    (4, torch.float32, torch.bfloat16, 37),
    (8, torch.int8, torch.float32, 300),
]
# Ops that touch no element of their tensors: allocation and views.
_NO_DATA_OPS = {
    "aten.empty.memory_format",
    "aten.empty_like.default",
    "aten.empty_strided.default",
    "aten.new_empty.default",
}


def _inside_collective() -> bool:
    """Whether the current op was issued by a ``torch.distributed`` collective itself (gloo
    finishes a reduce-scatter with a copy into the output when its work is waited on)."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename.endswith("distributed_c10d.py"):
            return True
        frame = frame.f_back
    return False


class GradientSizedOps(TorchDispatchMode):
    """Records every op, other than the kernels and collectives, that reads or writes a
    tensor of at least ``min_numel`` elements. Custom ops are seen as one call: the
    interpreter's own work inside a kernel runs below this mode."""

    def __init__(self, min_numel: int):
        super().__init__()
        self.min_numel = min_numel
        self.ops: list[str] = []
        self.kernels: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = str(func)
        if func.namespace in ("fsdp_ext", "c10d"):
            self.kernels.append(name)
        elif not func.is_view and name not in _NO_DATA_OPS and not _inside_collective():
            leaves = tree_leaves((args, kwargs, out))
            if any(isinstance(t, torch.Tensor) and t.numel() >= self.min_numel for t in leaves):
                self.ops.append(name)
        return out


def _reduce_scatter_steps(config, inputs, steps=3, device="cpu", node_size=None):
    rank, world = dist.get_rank(), dist.get_world_size()
    comm = LoCoReduceScatter(config, node_size=node_size)
    shard = inputs.shape[1] // world
    outs = []
    for step in range(steps):
        out = torch.empty(shard, dtype=inputs.dtype, device=device)
        comm(
            output_tensor=out,
            input_tensor=(inputs[rank].to(device) * (step + 1)).to(inputs.dtype),
            group=dist.group.WORLD,
            op=dist.ReduceOp.AVG,
        )
        outs.append(out.cpu())
    state = comm.feedback.state_dict() if comm.feedback is not None else {}
    return outs, {k: v.cpu().clone() for k, v in state.items()}, comm.stats.bytes_sent


def _inputs(world, shard, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(world, world * shard, generator=gen) * torch.logspace(-1, 1, world)[:, None]
    x[0, 3] = 40.0
    return x.to(dtype)


def _count_passes(config, inputs, node_size=None):
    """Ops touching gradient-sized memory in one steady-state call (after a warm-up call)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    shard = inputs.shape[1] // world
    comm = LoCoReduceScatter(config, node_size=node_size)
    out = torch.empty(shard)
    kwargs = dict(group=dist.group.WORLD, op=dist.ReduceOp.AVG)
    comm(output_tensor=out, input_tensor=inputs[rank].clone(), **kwargs)  # allocates e
    grad = inputs[rank].clone()
    with GradientSizedOps(min_numel=shard // 4) as mode:
        comm(output_tensor=out, input_tensor=grad, **kwargs)
    return mode.ops, mode.kernels


def _moe_grads():
    from benchmarks.moe import Case, build_model, global_batch, lm_loss
    from fsdp_ext import ParallelDims, apply_expert_parallel, shard_moe_model

    case = dataclasses.replace(Case(), num_layers=1)
    dims = ParallelDims(dist.get_world_size(), ep=2)
    dims.build_mesh("cpu")
    model = build_model(case)
    apply_expert_parallel(model, dims)
    shard_moe_model(model, dims)
    inputs, targets = global_batch(case, 0)
    rows = slice(dist.get_rank() * 4, dist.get_rank() * 4 + 4)
    result = {}
    for name in BACKENDS:
        model.zero_grad()
        with use_backend(name):
            loss = lm_loss(model, inputs[rows], targets[rows])
            loss.backward()
        result[name] = (loss.detach(), [p.grad.to_local().clone() for p in model.parameters()])
    return result


def _two_ranks():
    results = {"flat": {}}
    for i, (bits, error_dtype, dtype, shard) in enumerate(FLAT_CASES):
        config = LoCoConfig(bits=bits, error_dtype=error_dtype)
        inputs = _inputs(2, shard, dtype, seed=i)
        for name in BACKENDS:
            with use_backend(name):
                results["flat"][i, name] = _reduce_scatter_steps(config, inputs)
    with use_backend("triton"):
        results["passes"] = _count_passes(LoCoConfig(), _inputs(2, 1000, torch.float32, 9))
    results["moe"] = _moe_grads()
    return results


def _sharded(mesh):
    torch.manual_seed(0)
    dims = [64, 96, 64]
    model = nn.Sequential(*(nn.Linear(a, b) for a, b in itertools.pairwise(dims)))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _four_ranks():
    rank = dist.get_rank()
    results = {"hier": {}, "hsdp": {}}
    config = LoCoConfig(bits=4, error_dtype=torch.int8)
    inputs = _inputs(4, 100, torch.float32, seed=11)
    for name in BACKENDS:
        with use_backend(name):
            results["hier"][name] = _reduce_scatter_steps(config, inputs, node_size=2)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    for name in BACKENDS:
        model = _sharded(mesh["dp_shard"])
        enable(
            model,
            CommConfig(gradients=LoCoConfig(bits=4, group_size=32)),
            replicate_group=mesh["dp_replicate"].get_group(),
        )
        with use_backend(name):
            # three steps: the error written by step 2 first shows in step 3's gradients
            for step in range(3):
                gen = torch.Generator().manual_seed(100 * step + rank)
                x, y = torch.randn(4, 64, generator=gen), torch.randn(4, 64, generator=gen)
                nn.functional.mse_loss(model(x), y).backward()
        results["hsdp"][name] = [p.grad.to_local().clone() for p in model.parameters()]
    with use_backend("triton"):
        results["passes"] = _count_passes(config, _inputs(4, 1000, torch.float32, 12), node_size=2)
    return results


def _equal(a, b):
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def _assert_single_pass(ops, kernels, collective):
    assert ops == [], f"ops outside the kernels over gradient-sized memory: {ops}"
    # the send-side kernel, the exchange, the receive-side kernel, in that order
    assert kernels[-3:] == [
        "fsdp_ext.quantize_ef_to_payload.default",
        collective,
        "fsdp_ext.dequantize_reduce_from_payload.default",
    ], kernels


def _cuda_two_ranks():
    """Each flat case through the reference on CPU and the real kernels on CUDA."""
    results = {}
    for i, (bits, error_dtype, dtype, shard) in enumerate(FLAT_CASES):
        config = LoCoConfig(bits=bits, error_dtype=error_dtype)
        inputs = _inputs(2, shard, dtype, seed=i)
        with use_backend("reference"):
            results[i, "reference"] = _reduce_scatter_steps(config, inputs)
        with use_backend("triton"):
            results[i, "cuda"] = _reduce_scatter_steps(config, inputs, device="cuda:0")
    return results


@pytest.fixture(scope="module")
def two_ranks(triton_interpreter_fma):
    return run_distributed(_two_ranks, 2)


@pytest.fixture(scope="module")
def four_ranks(triton_interpreter_fma):
    return run_distributed(_four_ranks, 4)


@pytest.fixture(scope="module")
def cuda_two_ranks():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device: the real kernels on the data path")
    return run_distributed(_cuda_two_ranks, 2)


def test_loco_reduce_scatter_cuda_kernels_equal_cpu_reference(cuda_two_ranks):
    for result in cuda_two_ranks:
        for i in range(len(FLAT_CASES)):
            ref, gpu = result[i, "reference"], result[i, "cuda"]
            assert _equal(ref, gpu), FLAT_CASES[i]
            assert ref[0][0].abs().max() > 0


def test_loco_reduce_scatter_triton_equals_reference(two_ranks):
    for result in two_ranks:
        for i in range(len(FLAT_CASES)):
            ref, tri = result["flat"][i, "reference"], result["flat"][i, "triton"]
            assert _equal(ref, tri), FLAT_CASES[i]
            assert ref[0][0].abs().max() > 0  # something was reduced


def test_expert_parallel_dispatch_triton_equals_reference(two_ranks):
    for result in two_ranks:
        ref_loss, ref_grads = result["moe"]["reference"]
        tri_loss, tri_grads = result["moe"]["triton"]
        assert torch.equal(ref_loss, tri_loss)
        assert _equal(ref_grads, tri_grads)
        assert any(g.abs().max() > 0 for g in ref_grads)


def test_hierarchical_triton_equals_reference(four_ranks):
    for result in four_ranks:
        assert _equal(result["hier"]["reference"], result["hier"]["triton"])


def test_hsdp_hook_triton_equals_reference(four_ranks):
    for result in four_ranks:
        assert _equal(result["hsdp"]["reference"], result["hsdp"]["triton"])


def test_flat_reduce_scatter_is_single_pass(two_ranks):
    for result in two_ranks:
        _assert_single_pass(*result["passes"], "c10d.alltoall_base_.default")


def test_hierarchical_reduce_scatter_is_single_pass(four_ranks):
    for result in four_ranks:
        ops, kernels = result["passes"]
        _assert_single_pass(ops, kernels, "c10d.alltoall_base_.default")
        # before them, the full-precision reduce-scatter inside the node, one per node block
        assert kernels[:-3] == ["c10d._reduce_scatter_base_.default"] * 2, kernels
