"""The staged DTensors a background save keeps from save to save (``StagingBuffers``): handed
out again while the state's structure holds, rebuilt when a DTensor's placements or global
shape change under a buffer of the same local shape, and every checkpoint then still loads
bit for bit. Two gloo ranks, a few seconds."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from fsdp_ext import Checkpointer, SafeLoadPlanner, VerifiedFileSystemReader
from fsdp_ext.job.staging import StagingBuffers
from fsdp_ext.testing import run_distributed

WORLD = 2


class _Tensors:
    """A Stateful over a dict of DTensors that the test swaps between saves."""

    def __init__(self, tensors: dict):
        self.tensors = tensors

    def state_dict(self) -> dict:
        return dict(self.tensors)

    def load_state_dict(self, state: dict) -> None:
        self.tensors.update(state)


def _structures(mesh, seed: int) -> list[dict]:
    """Three states whose tensors have the same local shape (4, 4) and dtype on each rank,
    so that staging reuses the same buffers; only placements and global shapes differ.
    (A mesh that orders the ranks otherwise is no test of the mesh check: torch 2.13's
    ``distribute_tensor`` scatters by group rank, DCP places a shard by mesh coordinate.)"""
    gen = torch.Generator().manual_seed(seed)
    full_a, full_b = torch.randn(8, 4, generator=gen), torch.randn(4, 8, generator=gen)
    full_c = torch.randn(4, 4, generator=gen)
    return [
        {"w": distribute_tensor(full_a, mesh, [Shard(0)])},  # global (8, 4)
        {"w": distribute_tensor(full_b, mesh, [Shard(1)])},  # global (4, 8), another dim
        {"w": distribute_tensor(full_c, mesh, [Replicate()])},  # global (4, 4), replicated
    ]


def _saves_and_loads(root: str) -> bool:
    mesh = init_device_mesh("cpu", (WORLD,))
    staging = StagingBuffers()
    first = _structures(mesh, seed=1)[0]
    one, two = staging.stage(first), staging.stage(first)
    assert one["w"] is two["w"]  # unchanged structure: the same staged DTensor, no rebuild
    assert torch.equal(two["w"].to_local(), first["w"].to_local())

    holder = _Tensors({})
    ckpt = Checkpointer(root, extra={"t": holder}, keep=None)
    saved = {}
    for step in range(1, 7):  # each structure twice: A B C A B C
        state = _structures(mesh, seed=step)[(step - 1) % 3]
        holder.tensors = dict(state)
        ckpt.save(step, blocking=False)
        saved[step] = {k: v.full_tensor().clone() for k, v in state.items()}
        for v in state.values():
            v.to_local().fill_(float("nan"))  # training changes the state at once
    ckpt.close()
    dist.barrier()
    for step, want in saved.items():
        template = _structures(mesh, seed=99)[(step - 1) % 3]
        target = {"t": {k: DTensor.from_local(torch.zeros_like(v.to_local()), mesh, v.placements,
                                              shape=v.shape, stride=v.stride())
                        for k, v in template.items()}}  # fmt: skip
        path = f"{root}/step-{step:07d}"
        dcp.load(target, storage_reader=VerifiedFileSystemReader(path), planner=SafeLoadPlanner())
        for key, tensor in want.items():
            got = target["t"][key]
            assert got.shape == tensor.shape, (step, got.shape, tensor.shape)
            assert torch.equal(got.full_tensor(), tensor), step
    return True


def test_staged_dtensors_are_reused_and_rebuilt_when_placements_or_shapes_change(tmp_path):
    results = run_distributed(_saves_and_loads, WORLD, str(tmp_path / "ckpts"), timeout=180)
    assert results == [True] * WORLD
