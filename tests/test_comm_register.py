"""fsdp_ext.enable with a gradient codec: stats, remove, HSDP all-reduce hook,
checkpointed error buffers."""

import itertools

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from fsdp_ext import CommConfig, CommHandle, LoCoConfig, enable
from fsdp_ext.testing import run_distributed
from tests.meshes import cpu_mesh


def _sharded(dims, mesh=None, seed=0):
    torch.manual_seed(seed)
    mesh = cpu_mesh() if mesh is None else mesh
    model = nn.Sequential(*(nn.Linear(a, b) for a, b in itertools.pairwise(dims)))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _step(model, rank, step, width):
    gen = torch.Generator().manual_seed(1000 * step + rank)
    x, y = torch.randn(4, width, generator=gen), torch.randn(4, width, generator=gen)
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    return loss


def _stats_and_remove():
    rank = dist.get_rank()
    model = _sharded([256, 256, 256])
    handle = enable(model, CommConfig(gradients=LoCoConfig()))
    _step(model, rank, 0, 256)
    stats = handle.stats
    model.zero_grad()
    handle.remove()
    _step(model, rank, 1, 256)
    after_remove = [p.grad.to_local().clone() for p in model.parameters()]
    plain = _sharded([256, 256, 256])
    _step(plain, rank, 1, 256)
    expected = [p.grad.to_local() for p in plain.parameters()]
    same = all(torch.equal(a, b) for a, b in zip(after_remove, expected, strict=True))
    return stats, handle.stats, same


def test_stats_count_bytes_and_remove_restores_default():
    for stats, stats_after_remove, same in run_distributed(_stats_and_remove, 2):
        # per unit: weight 128 x 256 + bias 128 per rank -> 32896 elements = 257 groups of 128
        payload = 257 * (64 + 4)
        assert stats.reductions == 2
        assert stats.bytes_sent == 2 * payload  # two units, one peer each
        assert stats.bytes_uncompressed == 2 * 32896 * 4
        assert stats.compression_ratio <= 0.14
        assert stats_after_remove == stats  # LoCo no longer runs ...
        assert same  # ... and gradients are the stock reduce-scatter's, bit for bit


def _hsdp(bits):
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    model = _sharded([64, 96, 64], mesh=mesh["dp_shard"])
    handle = enable(
        model,
        CommConfig(gradients=LoCoConfig(bits=bits, group_size=32)),
        replicate_group=mesh["dp_replicate"].get_group(),
    )
    _step(model, rank, 0, 64)
    grads = [p.grad.full_tensor() for p in model.parameters()]
    torch.manual_seed(0)
    ref_model = nn.Sequential(nn.Linear(64, 96), nn.Linear(96, 64))
    for r in range(4):
        _step(ref_model, r, 0, 64)
    exact = [p.grad / 4 for p in ref_model.parameters()]
    shard_only = nn.Sequential(nn.Linear(64, 96), nn.Linear(96, 64))
    shard_only.load_state_dict(ref_model.state_dict())
    shard_only.zero_grad()
    for r in range(2 * (rank // 2), 2 * (rank // 2) + 2):  # this replica's shard group
        _step(shard_only, r, 0, 64)
    without_hook = [p.grad / 2 for p in shard_only.parameters()]
    rel = max(float((g - e).norm() / e.norm()) for g, e in zip(grads, exact, strict=True))
    rel_no_hook = max(
        float((g - e).norm() / e.norm()) for g, e in zip(without_hook, exact, strict=True)
    )
    return grads, rel, rel_no_hook, handle.stats


@pytest.mark.parametrize("bits", [4, 8])
def test_hsdp_all_reduce_hook_gives_exact_mean(bits):
    out = run_distributed(_hsdp, 4, bits)
    for rank, (grads, rel, rel_no_hook, stats) in enumerate(out):
        # replicas (ranks r and r + 2 hold the same shard) see the very same bytes
        replica = out[(rank + 2) % 4][0]
        assert all(torch.equal(a, b) for a, b in zip(grads, replica, strict=True))
        assert rel < (0.2 if bits == 4 else 0.02), rel
        assert rel < rel_no_hook / 3  # the replicas really were averaged
        assert stats.bytes_sent < 0.3 * stats.bytes_uncompressed


class _App(Stateful):
    def __init__(self, model, optim):
        self.model, self.optim = model, optim

    def state_dict(self):
        model_sd, optim_sd = get_state_dict(self.model, self.optim)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state):
        set_state_dict(
            self.model, self.optim, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )


def _fresh():
    model = _sharded([48, 80, 48])
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    handle = enable(model, CommConfig(gradients=LoCoConfig(group_size=32, reset_interval=7)))
    return model, optim, handle


def _train(model, optim, steps, start):
    for step in range(start, start + steps):
        _step(model, dist.get_rank(), step, 48)
        optim.step()
        optim.zero_grad()


def _resume(path):
    model, optim, handle = _fresh()
    _train(model, optim, 20, 0)
    straight = [p.to_local().clone() for p in model.parameters()]

    model, optim, handle = _fresh()
    _train(model, optim, 10, 0)
    dcp.save({"app": _App(model, optim), "comm": handle}, checkpoint_id=path)
    saved_error = handle._units["0"].reduce_scatter.feedback.error.clone()

    results = {}
    for load_comm in (True, False):
        model, optim, handle = _fresh()
        state = {"app": _App(model, optim)}
        if load_comm:
            state["comm"] = handle
        dcp.load(state, checkpoint_id=path)
        loaded = handle._units["0"].reduce_scatter.feedback
        results[load_comm] = dict(
            error_restored=loaded.error is not None and torch.equal(loaded.error, saved_error),
            error_fresh=loaded.error is None or not bool(loaded.error.any()),
            reductions=loaded.reductions,
        )
        _train(model, optim, 10, 10)
        results[load_comm]["params"] = [p.to_local() for p in model.parameters()]
    return straight, results, isinstance(handle, CommHandle)


def test_exact_resume_with_error_buffers(tmp_path):
    for straight, results, _ in run_distributed(_resume, 2, str(tmp_path / "ckpt")):
        resumed = results[True]
        assert resumed["error_restored"] and resumed["reductions"] == 10
        assert all(torch.equal(a, b) for a, b in zip(straight, resumed["params"], strict=True))
        # control: without the comm state the buffers start fresh (no error, no reductions)
        # while the saved error was not zero, and training drifts, so the buffers matter
        assert results[False]["error_fresh"] and results[False]["reductions"] == 0
        assert not resumed["error_fresh"]
        assert not all(
            torch.equal(a, b) for a, b in zip(straight, results[False]["params"], strict=True)
        )
