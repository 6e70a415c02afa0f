"""Bytes each rank actually writes, counted on disk: file sizes, never the plan.

The planner's promise (a big replicated tensor cut into pieces written by different ranks)
only counts if the files on disk say so. Each data file's writer is read from its name
(``__R_...``) and cross-checked against the manifest's record; its size is ``os.stat``'s.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from fsdp_ext.checkpoint import SpreadFileSystemWriter, SpreadSavePlanner, verify_checkpoint
from fsdp_ext.testing import run_distributed

WORLD = 4
BIG = (4096, 1024)  # 16 MiB of fp32: far more than a fair share (about 4.2 MiB)
SMALL = 10240  # 40 KiB each
N_SMALL = 20


def hidden_style_state() -> dict[str, torch.Tensor]:
    """One 16 MiB replicated tensor and twenty 40 KiB ones, the same on every rank."""
    gen = torch.Generator().manual_seed(0)
    state = {"embed.weight": torch.randn(BIG, generator=gen)}
    for i in range(N_SMALL):
        state[f"layers.{i}.norm.weight"] = torch.randn(SMALL, generator=gen)
    return state


def tensor_bytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def _save(path: str, layout: str) -> None:
    state = hidden_style_state()
    if layout == "hsdp":
        mesh = init_device_mesh("cpu", (2, dist.get_world_size() // 2))
        state = {k: distribute_tensor(v, mesh, [Replicate(), Shard(0)]) for k, v in state.items()}
    dcp.save(
        {"model": state},
        storage_writer=SpreadFileSystemWriter(path),
        planner=SpreadSavePlanner(),
    )


def bytes_on_disk_per_rank(path: Path) -> list[int]:
    """Size on disk of every data file, summed per writing rank.

    The rank comes from the file name (``__R_...``); the manifest must agree, and its
    recorded sizes must be the sizes on disk.
    """
    report = verify_checkpoint(path)
    assert report.ok, report.problems
    per_rank = [0] * WORLD
    data_files = sorted(f for f in os.listdir(path) if f.endswith(".distcp"))
    assert sorted(report.files) == data_files
    for name in data_files:
        rank = int(name.split("_")[2])
        size = os.stat(path / name).st_size
        assert report.files[name].rank == rank, name
        assert report.files[name].size == size, name
        per_rank[rank] += size
    return per_rank


@pytest.mark.parametrize("layout", ["replicated", "hsdp"])
def test_bytes_written_per_rank_are_balanced_on_disk(tmp_path, layout):
    """4 ranks, a 16 MiB replicated tensor and twenty 40 KiB ones: the bytes each rank
    writes are within max/mean 1.10, every byte is written once (framing within 2 %), and
    the stock reader loads the result bitwise."""
    path = tmp_path / "ckpt"
    run_distributed(_save, WORLD, str(path), layout, timeout=180)
    expected = hidden_style_state()
    per_rank = bytes_on_disk_per_rank(path)
    total = tensor_bytes(expected)
    mean = sum(per_rank) / WORLD
    assert max(per_rank) / mean <= 1.10, per_rank
    assert total <= sum(per_rank) <= 1.02 * total, (sum(per_rank), total)

    loaded = {"model": {k: torch.zeros_like(v) for k, v in expected.items()}}
    dcp.load(loaded, storage_reader=dcp.FileSystemReader(path))
    assert all(torch.equal(loaded["model"][k], v) for k, v in expected.items())


def _stock_default_bytes(path: str) -> None:
    dcp.save({"model": hidden_style_state()}, storage_writer=dcp.FileSystemWriter(path))


def test_stock_default_writes_the_big_tensor_on_one_rank(tmp_path):
    """The contrast: stock DCP never cuts a tensor, so one rank writes all 16 MiB."""
    path = tmp_path / "stock"
    run_distributed(_stock_default_bytes, WORLD, str(path), timeout=180)
    per_rank = [0] * WORLD
    for name in os.listdir(path):
        if name.endswith(".distcp"):
            per_rank[int(name.split("_")[2])] += os.stat(path / name).st_size
    assert max(per_rank) >= BIG[0] * BIG[1] * 4
    assert max(per_rank) / (sum(per_rank) / WORLD) > 3
