"""LoCo under the settings real jobs use: HSDP with a gradient divide factor, stream safety of
the all-reduce hook, buffers on the reduction's device (meta init), fp16 gradients."""

import itertools

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

import fsdp_ext.comm.all_reduce_hook as all_reduce_hook
from fsdp_ext import CommConfig, LoCoConfig, enable
from fsdp_ext.testing import run_distributed
from tests.meshes import cpu_mesh


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))


def _loss(model, rank, dtype=torch.float32):
    gen = torch.Generator().manual_seed(50 + rank)
    x, y = torch.randn(8, 32, generator=gen), torch.randn(8, 32, generator=gen)
    out = model(x.to(dtype))
    return nn.functional.mse_loss(out.float(), y)


def _exact(world, divide):
    model = _net()
    for rank in range(world):
        _loss(model, rank).backward()
    return [p.grad / divide for p in model.parameters()]


def _rel(grads, ref):
    return max(float((g.float() - r).norm() / r.norm()) for g, r in zip(grads, ref, strict=True))


def _hsdp_divide_factor():
    held = []
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    model = _net()
    for layer in (model[0], model[2], model):
        fully_shard(layer, mesh=mesh["dp_shard"])
    enable(
        model,
        CommConfig(gradients=LoCoConfig(group_size=32, bits=8)),
        replicate_group=mesh["dp_replicate"].get_group(),
    )
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(4.0)  # S * R: the mean over all four ranks
    original = all_reduce_hook.hold_for_current_stream
    all_reduce_hook.hold_for_current_stream = lambda t: (held.append(t), original(t))
    try:
        _loss(model, dist.get_rank()).backward()
    finally:
        all_reduce_hook.hold_for_current_stream = original
    grads = [p.grad.full_tensor() for p in model.parameters()]
    # the tensors the hook held are the very buffers FSDP turned into the sharded gradients
    grad_ptrs = {p.grad.to_local().untyped_storage().data_ptr() for p in model.parameters()}
    held_ptrs = {t.untyped_storage().data_ptr() for t in held}
    return grads, len(held), held_ptrs == grad_ptrs


def test_hsdp_hook_honours_gradient_divide_factor_and_holds_its_buffer():
    exact = _exact(4, 4.0)
    for grads, held, same in run_distributed(_hsdp_divide_factor, 4):
        assert _rel(grads, exact) < 0.05  # sum / 4, as set (it was sum / 8)
        assert held == 2 and same  # one reduce output per unit, kept alive on its stream


def _meta_init_and_fp16():
    rank = dist.get_rank()
    out = {}
    with torch.device("meta"):
        model = _net()
    for layer in (model[0], model[2], model):
        fully_shard(layer, mesh=cpu_mesh())
    handle = enable(model, CommConfig(gradients=LoCoConfig(group_size=32)))
    handle.state_dict()  # a load before to_empty allocates the buffers (where the reduction runs)
    out["devices"] = sorted(
        {str(f.error.device) for u in handle._units.values() for f in u.feedbacks()}
    )
    model.to_empty(device="cpu")
    reference = _net()
    with torch.no_grad():
        for p, r in zip(model.parameters(), reference.parameters(), strict=True):
            p.copy_(torch.distributed.tensor.distribute_tensor(r, p.device_mesh, p.placements))
    _loss(model, rank).backward()
    out["meta_grads"] = [p.grad.full_tensor() for p in model.parameters()]
    # fp16 gradients: reduced in fp32 inside the comm, written back in fp16
    model = _net()
    mp = MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float16)
    for layer in (model[0], model[2], model):
        fully_shard(layer, mp_policy=mp, mesh=cpu_mesh())
    enable(model, CommConfig(gradients=LoCoConfig(group_size=32)))
    _loss(model, rank, torch.float16).backward()
    out["fp16_grads"] = [p.grad.full_tensor() for p in model.parameters()]
    # a reduce dtype the codec cannot take is refused at registration, not mid-backward
    model = _net().double()
    fully_shard(model, mesh=cpu_mesh())
    with pytest.raises(ValueError, match="reduce_dtype") as exc:
        enable(model, CommConfig(gradients=LoCoConfig(group_size=32)))
    out["float64"] = str(exc.value)
    # "auto" on one node (the harness sets LOCAL_WORLD_SIZE to the world): full precision
    model = _net()
    for layer in (model[0], model[2], model):
        fully_shard(layer, mesh=cpu_mesh())
    handle = enable(
        model, CommConfig(gradients=LoCoConfig(group_size=32), hierarchical=True, node_size="auto")
    )
    _loss(model, rank).backward()
    out["auto_grads"] = [p.grad.full_tensor() for p in model.parameters()]
    out["auto_bytes"] = (handle.stats.bytes_sent, handle.stats.intra_node_bytes)
    return out


def test_meta_init_buffers_follow_the_reduction_and_fp16_is_supported():
    exact = _exact(2, 2.0)
    for out in run_distributed(_meta_init_and_fp16, 2):
        assert out["devices"] == ["cpu"]  # not meta, the local shards' device
        assert _rel(out["meta_grads"], exact) < 0.25
        assert all(g.dtype == torch.float32 for g in out["fp16_grads"])
        assert _rel(out["fp16_grads"], exact) < 0.25
        assert "torch.float64" in out["float64"]
        assert out["auto_bytes"][0] == 0 and out["auto_bytes"][1] > 0
        assert _rel(out["auto_grads"], exact) < 1e-5


def _hierarchical_sub_meshes(node_size):
    """HSDP 2 x 2 (shard groups inside a node) and ep=2 x efsdp=2 (experts on a sub-mesh),
    with nodes of ``node_size`` ranks (None: flat)."""
    from fsdp_ext import ParallelDims

    rank = dist.get_rank()
    cfg = CommConfig(
        gradients=LoCoConfig(group_size=32),
        hierarchical=node_size is not None,
        node_size=node_size or "auto",
    )
    out = {}
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    model = _net()
    for layer in (model[0], model[2], model):
        fully_shard(layer, mesh=mesh["dp_shard"])
    handle = enable(model, cfg, replicate_group=mesh["dp_replicate"].get_group())
    _loss(model, rank).backward()
    out["hsdp"] = [p.grad.full_tensor() for p in model.parameters()]
    out["hsdp_rs_bytes"] = sum(u.reduce_scatter.stats.bytes_sent for u in handle._units.values())
    dims = ParallelDims(4, ep=2)
    dims.build_mesh("cpu")
    model = _net()
    fully_shard(model[2], mesh=dims.efsdp_mesh)  # an "expert" on its own sub-mesh
    fully_shard(model, mesh=dims.dp_mesh)
    handle = enable(model, cfg)
    _loss(model, rank).backward()
    out["ep"] = [p.grad.full_tensor() for p in model.parameters()]
    out["efsdp_ranks"] = dist.get_process_group_ranks(dims.efsdp_mesh.get_group())
    out["ep_intra_bytes"] = handle.stats.intra_node_bytes
    return out


@pytest.mark.slow
def test_hierarchical_on_sub_meshes_within_the_flat_bound():
    flat = run_distributed(_hierarchical_sub_meshes, 4, None)
    hier = run_distributed(_hierarchical_sub_meshes, 4, 2)
    exact = _exact(4, 4.0)
    for rank, (f, h) in enumerate(zip(flat, hier, strict=True)):
        # HSDP: each shard group sits inside one node, so its reduce-scatter is full precision
        assert h["hsdp_rs_bytes"] == 0 and f["hsdp_rs_bytes"] > 0
        assert _rel(h["hsdp"], exact) <= 1.05 * _rel(f["hsdp"], exact) + 1e-3
        # experts: reduced over the efsdp group only; dense params over all four ranks
        group = h["efsdp_ranks"]
        assert rank in group and len(group) == 2
        model = _net()
        for r in group:
            _loss(model, r).backward()
        expert_exact = [p.grad / 2 for p in model[2].parameters()]
        for key in ("ep",):
            assert _rel(h[key][:2], exact[:2]) <= 1.05 * _rel(f[key][:2], exact[:2]) + 0.02
            assert _rel(h[key][2:], expert_exact) <= 1.05 * _rel(f[key][2:], expert_exact) + 0.02
            assert _rel(h[key], exact[:2] + expert_exact) < 0.25
        assert h["ep_intra_bytes"] > 0


def _stage(pp_rank):
    torch.manual_seed(pp_rank)
    dims = (32, 64, 32) if pp_rank == 0 else (32, 48, 48, 32)  # stages differ in units
    layers = [nn.Linear(a, b) for a, b in itertools.pairwise(dims)]
    return nn.Sequential(*layers)


def _pipeline_stage_dp_meshes():
    """pp=2 x dp=2 with the dp groups across the two emulated nodes: every rank registers
    only its own stage's units, yet the node subgroups of all dp groups are created alike."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    pp_rank = mesh["pp"].get_local_rank()
    model = _stage(pp_rank)
    for layer in model:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    handle = enable(
        model, CommConfig(gradients=LoCoConfig(group_size=32), hierarchical=True, node_size=2)
    )
    gen = torch.Generator().manual_seed(dist.get_rank())
    x, y = torch.randn(8, 32, generator=gen), torch.randn(8, 32, generator=gen)
    nn.functional.mse_loss(model(x), y).backward()
    grads = [p.grad.full_tensor() for p in model.parameters()]
    dp_ranks = dist.get_process_group_ranks(mesh["dp"].get_group())
    return pp_rank, dp_ranks, grads, handle.stats.bytes_sent


@pytest.mark.slow
def test_hierarchical_on_pipeline_stage_dp_meshes():
    for pp_rank, dp_ranks, grads, sent in run_distributed(_pipeline_stage_dp_meshes, 4):
        assert len(dp_ranks) == 2 and dp_ranks[0] // 2 != dp_ranks[1] // 2  # across nodes
        model = _stage(pp_rank)
        for r in dp_ranks:
            gen = torch.Generator().manual_seed(r)
            x, y = torch.randn(8, 32, generator=gen), torch.randn(8, 32, generator=gen)
            nn.functional.mse_loss(model(x), y).backward()
        exact = [p.grad / 2 for p in model.parameters()]
        assert _rel(grads, exact) < 0.25 and sent > 0  # 4-bit across the nodes
