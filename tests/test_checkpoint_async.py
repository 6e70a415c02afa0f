"""``dcp.async_save`` with our writer and planner, in DCP's thread and process modes.

The process mode pickles the writer into DCP's checkpoint process (spawned, with its own
gloo group), so everything the writer holds must pickle. Each save is loaded back and
compared bitwise with the tensors built from the seed in the test process.
"""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from fsdp_ext.checkpoint import (
    SafeLoadPlanner,
    SpreadFileSystemWriter,
    SpreadSavePlanner,
    VerifiedFileSystemReader,
    verify_checkpoint,
)
from fsdp_ext.testing import run_distributed

WORLD = 2


def full_state(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(64, 16, generator=gen),  # replicated, split on save
        "layers.0.w": torch.randn(24, 8, generator=gen),  # FSDP-sharded
        "layers.1.w": torch.randn(10, 8, generator=gen),
    }


def rank_state(seed: int) -> dict:
    full = full_state(seed)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full.items() if "layers" in k}
    return {"model": {"embed.weight": full["embed.weight"].clone(), **model}, "step": seed}


def _async_save_then_load(path: str, mode: str) -> bool:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")  # the checkpoint process's own group
    # DCP's process mode starts a child process; the harness's ranks are daemonic, which
    # multiprocessing forbids to have children (the harness still kills this rank's tree)
    mp.current_process().daemon = False
    kind = {"thread": AsyncCheckpointerType.THREAD, "process": AsyncCheckpointerType.PROCESS}
    state = rank_state(seed=3)
    future = dcp.async_save(
        state,
        storage_writer=SpreadFileSystemWriter(path),
        planner=SpreadSavePlanner(),
        async_checkpointer_type=kind[mode],
    )
    # staging copied the state: changing it now must not change the checkpoint
    state["model"]["embed.weight"].zero_()
    future.result()
    dist.barrier()
    target = rank_state(seed=0)
    dcp.load(target, storage_reader=VerifiedFileSystemReader(path), planner=SafeLoadPlanner())
    want = rank_state(seed=3)
    return target["step"] == 3 and all(
        torch.equal(got.to_local() if hasattr(got, "to_local") else got, _local(want, k))
        for k, got in target["model"].items()
    )


def _local(state: dict, key: str) -> torch.Tensor:
    value = state["model"][key]
    return value.to_local() if hasattr(value, "to_local") else value


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_async_save_loads_bitwise(tmp_path, mode):
    path = tmp_path / "ckpt"
    assert (
        run_distributed(_async_save_then_load, WORLD, str(path), mode, timeout=240)
        == [True] * WORLD
    )
    assert verify_checkpoint(path).ok
    loaded = {"model": {k: torch.zeros_like(v) for k, v in full_state(0).items()}, "step": 0}
    dcp.load(loaded, storage_reader=dcp.FileSystemReader(path))  # and with the stock reader
    assert loaded["step"] == 3
    assert all(torch.equal(loaded["model"][k], v) for k, v in full_state(3).items())
