"""The verified reader's read-ahead: files read whole on a few threads within a byte budget,
each read once, and every check (size, CRC-32, a missing file) as strict on that path as on
the streamed one. Single-process saves (``dcp`` without a process group)."""

from __future__ import annotations

import os
import re
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from fsdp_ext.checkpoint import (
    SafeLoadPlanner,
    SpreadFileSystemWriter,
    SpreadSavePlanner,
    VerifiedFileSystemReader,
)
from fsdp_ext.checkpoint import reader as reader_module

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

LAYERS = 6


def state() -> dict:
    gen = torch.Generator().manual_seed(0)
    sd = {f"layers.{i}.w": torch.randn(64, 32, generator=gen) for i in range(LAYERS)}
    sd["embed"] = torch.randn(128, 32, generator=gen)
    return sd


def save(path: Path) -> Path:
    dcp.save(
        state(),
        storage_writer=SpreadFileSystemWriter(path, min_file_bytes=0),
        planner=SpreadSavePlanner(),
    )
    return path.parent / os.readlink(path) if path.is_symlink() else path


def load(path: Path) -> dict:
    got = {k: torch.zeros_like(v) for k, v in state().items()}
    dcp.load(got, storage_reader=VerifiedFileSystemReader(path), planner=SafeLoadPlanner())
    return got


def data_files(root: Path) -> list[Path]:
    return sorted(root.glob("*.distcp"))


@pytest.mark.parametrize("read_ahead", [True, False], ids=["read-ahead", "streamed"])
def test_every_check_holds_on_both_read_paths(tmp_path, monkeypatch, read_ahead):
    if not read_ahead:
        monkeypatch.setattr(reader_module, "READ_AHEAD_FILE_BYTES", 0)
    root = save(tmp_path / "ckpt")
    files = data_files(root)
    assert len(files) == LAYERS + 1  # one file per layer, and one for the rest
    got = load(tmp_path / "ckpt")
    assert all(torch.equal(got[k], v) for k, v in state().items())

    victim = files[2]
    named = re.escape(str(victim))
    good = victim.read_bytes()
    flipped = bytearray(good)
    flipped[len(flipped) // 2] ^= 0x01
    victim.write_bytes(bytes(flipped))
    with pytest.raises(CheckpointException, match=rf"{named}: crc32 [0-9a-f]{{8}}, the manifest"):
        load(tmp_path / "ckpt")
    victim.write_bytes(good[:-1])
    with pytest.raises(CheckpointException, match=rf"{named}: size {len(good) - 1} bytes"):
        load(tmp_path / "ckpt")
    victim.unlink()
    with pytest.raises(CheckpointException, match=rf"{named}: missing \({len(good)} bytes"):
        load(tmp_path / "ckpt")


def test_read_ahead_overlaps_files_within_its_budget_and_reads_each_once(tmp_path, monkeypatch):
    """The first file's read waits for the second's to start: only a reader that reads ahead
    gets past it (a sequential one would time out and fail the assertion). The bytes held
    ahead never exceed the budget, and every file is read exactly once (no second pass for
    the checksum)."""
    root = save(tmp_path / "ckpt")
    sizes = sorted(f.stat().st_size for f in data_files(root))
    budget = sizes[-1] + sizes[-2]  # room for two files at a time, never three
    monkeypatch.setattr(reader_module, "READ_AHEAD_BUDGET", budget)
    real = reader_module._read_whole
    second_started = threading.Event()
    lock = threading.Lock()
    reads: list[str] = []
    in_flight: dict[str, int] = {}
    most_in_flight = [0]

    def watched(path: Path, checksums: bool):
        with lock:
            first = not reads
            reads.append(path.name)
            if len(reads) == 2:
                second_started.set()
            in_flight[path.name] = path.stat().st_size
            most_in_flight[0] = max(most_in_flight[0], sum(in_flight.values()))
        if first:
            assert second_started.wait(timeout=30), "the second file was not read ahead"
        try:
            return real(path, checksums)
        finally:
            with lock:
                del in_flight[path.name]

    monkeypatch.setattr(reader_module, "_read_whole", watched)
    opened: list[str] = []
    real_open = open

    def counting_open(file, mode="r", *args, **kwargs):
        if str(file).endswith(".distcp"):
            opened.append(Path(file).name)
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr("builtins.open", counting_open)
    got = load(tmp_path / "ckpt")
    assert all(torch.equal(got[k], v) for k, v in state().items())
    names = sorted(f.name for f in data_files(root))
    assert sorted(reads) == names  # every data file read ahead, once
    assert sorted(opened) == names  # and opened once: nothing streamed it again
    assert 2 * sizes[0] <= most_in_flight[0] <= budget
