"""The verified reader's read path: files read whole ahead on a few threads within a byte
budget that holds until DCP is done with each file, big files streamed through one chunk,
each tensor's bytes copied straight into the destination, and every check (size, CRC-32, a
missing file) as strict on each path. Single-process saves (``dcp`` without a process
group), except the load that a save publishes over (two gloo ranks)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import threading
import time
import tracemalloc
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.api import CheckpointException

from fsdp_ext.checkpoint import (
    SafeLoadPlanner,
    SpreadFileSystemWriter,
    SpreadSavePlanner,
    VerifiedFileSystemReader,
)
from fsdp_ext.checkpoint import reader as reader_module
from fsdp_ext.testing import RankError, run_distributed

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

LAYERS = 6


def state(rows: int = 64) -> dict:
    gen = torch.Generator().manual_seed(0)
    sd = {f"layers.{i}.w": torch.randn(rows, 32, generator=gen) for i in range(LAYERS)}
    sd["embed"] = torch.randn(2 * rows, 32, generator=gen)
    return sd


def save(path: Path, rows: int = 64, **kwargs) -> Path:
    dcp.save(
        state(rows),
        storage_writer=SpreadFileSystemWriter(path, min_file_bytes=0, **kwargs),
        planner=SpreadSavePlanner(),
    )
    return path.parent / os.readlink(path) if path.is_symlink() else path


def load(path: Path, rows: int = 64, **kwargs) -> dict:
    got = {k: torch.zeros_like(v) for k, v in state(rows).items()}
    reader = VerifiedFileSystemReader(path, **kwargs)
    dcp.load(got, storage_reader=reader, planner=SafeLoadPlanner())
    return got


def data_files(root: Path) -> list[Path]:
    return sorted(root.glob("*.distcp"))


def record_reads_ahead(monkeypatch) -> list[str]:
    """The names of the files read ahead, in the order their reads start."""
    names: list[str] = []
    real = reader_module._read_whole

    def watched(dir_fd, name, size, checksums):
        names.append(name)
        return real(dir_fd, name, size, checksums)

    monkeypatch.setattr(reader_module, "_read_whole", watched)
    return names


@pytest.mark.parametrize("read_ahead", [True, False], ids=["read-ahead", "streamed"])
def test_every_check_holds_on_both_read_paths(tmp_path, monkeypatch, read_ahead):
    if not read_ahead:
        monkeypatch.setattr(reader_module, "READ_AHEAD_FILE_BYTES", 0)
        monkeypatch.setattr(reader_module, "READ_CHUNK_BYTES", 1000)  # rows split over chunks
    reads = record_reads_ahead(monkeypatch)
    root = save(tmp_path / "ckpt")
    files = data_files(root)
    assert len(files) == LAYERS + 1  # one file per layer, and one for the rest
    got = load(tmp_path / "ckpt")
    assert all(torch.equal(got[k], v) for k, v in state().items())
    assert len(reads) == (len(files) if read_ahead else 0)

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


@pytest.mark.parametrize("read_ahead", [True, False], ids=["read-ahead", "streamed"])
def test_sizes_alone_are_checked_on_both_read_paths(tmp_path, monkeypatch, read_ahead):
    """Saved with ``checksums=False`` and loaded with ``require_checksums=False``, the size
    is the only check: a file one byte short (or long) must still be refused by name."""
    if not read_ahead:
        monkeypatch.setattr(reader_module, "READ_AHEAD_FILE_BYTES", 0)
    root = save(tmp_path / "ckpt", checksums=False)
    victim = data_files(root)[3]
    good = victim.read_bytes()
    for damaged in (good[:-1], good + b"\0"):
        victim.write_bytes(damaged)
        with pytest.raises(
            CheckpointException,
            match=rf"{re.escape(str(victim))}: size {len(damaged)} bytes, the manifest expects "
            rf"{len(good)}",
        ):
            load(tmp_path / "ckpt", require_checksums=False)
    victim.write_bytes(good)
    got = load(tmp_path / "ckpt", require_checksums=False)
    assert all(torch.equal(got[k], v) for k, v in state().items())


def test_read_ahead_overlaps_files_and_reads_each_once(tmp_path, monkeypatch):
    """The first file's read waits for the second's to start: only a reader that reads ahead
    gets past it (a sequential one would time out and fail the assertion). Every file is
    opened exactly once (no second pass for the checksum)."""
    root = save(tmp_path / "ckpt")
    real = reader_module._read_whole
    second_started = threading.Event()
    reads: list[str] = []

    def watched(dir_fd, name, size, checksums):
        first = not reads
        reads.append(name)
        if len(reads) == 2:
            second_started.set()
        if first:
            assert second_started.wait(timeout=30), "the second file was not read ahead"
        return real(dir_fd, name, size, checksums)

    monkeypatch.setattr(reader_module, "_read_whole", watched)
    opened: list[str] = []
    real_open = os.open

    def counting_open(path, flags, *args, **kwargs):
        if str(path).endswith(".distcp"):
            opened.append(Path(path).name)
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", counting_open)
    got = load(tmp_path / "ckpt")
    assert all(torch.equal(got[k], v) for k, v in state().items())
    names = sorted(f.name for f in data_files(root))
    assert sorted(reads) == names and sorted(opened) == names


ROWS = 4096
FILE_BYTES = ROWS * 32 * 4  # 512 KiB of floats per layer file, plus its zip framing


@pytest.mark.parametrize("read_ahead", [True, False], ids=["read-ahead", "streamed"])
def test_the_bytes_held_stay_within_the_budget_plus_one_chunk(tmp_path, monkeypatch, read_ahead):
    """Python's own allocations during the load (tracemalloc: the read-ahead buffers, the
    chunk, the parsing; not torch's tensors, so not the destination) peak within the
    budget plus one chunk plus a small allowance, while three files are held at once; and
    every file is read ahead, once (the budget is given back after each file). Streamed,
    only the chunk is held. The allowance covers what a load allocates whatever the sizes
    (DCP's plans, torch.load's parsing: about 90 KB here, after a first load that imports
    and caches), far below a file's 512 KB."""
    root = save(tmp_path / "ckpt", rows=ROWS)
    sizes = sorted(f.stat().st_size for f in data_files(root))
    # layers (each with its framing, and the zeros under one block that a file written
    # around the page cache puts before a large tensor); embed is 2x
    assert sizes[0] > FILE_BYTES and sizes[-2] < FILE_BYTES + 2 * 4096
    budget, chunk, allowance = 3 * sizes[-2] + 100, 64 << 10, 128 << 10
    monkeypatch.setattr(reader_module, "READ_AHEAD_BUDGET", budget)
    monkeypatch.setattr(reader_module, "READ_CHUNK_BYTES", chunk)
    if not read_ahead:
        monkeypatch.setattr(reader_module, "READ_AHEAD_FILE_BYTES", 0)
    load(tmp_path / "ckpt", rows=ROWS)  # untimed: the first load imports and caches
    reads = record_reads_ahead(monkeypatch)
    got = {k: torch.zeros_like(v) for k, v in state(ROWS).items()}
    reader = VerifiedFileSystemReader(tmp_path / "ckpt")
    tracemalloc.start()
    try:
        dcp.load(got, storage_reader=reader, planner=SafeLoadPlanner())
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert all(torch.equal(got[k], v) for k, v in state(ROWS).items())
    if read_ahead:
        assert sorted(reads) == sorted(f.name for f in data_files(root))
        assert 2 * sizes[0] < peak <= budget + chunk + allowance, (peak, budget)
    else:
        assert reads == [] and peak <= chunk + allowance, peak


def test_files_over_the_cap_are_streamed_not_read_whole(tmp_path, monkeypatch):
    """The cap on reading a file whole is 256 MB (docs/checkpoint.md); a file over it is
    streamed while the smaller ones around it are read ahead."""
    assert reader_module.READ_AHEAD_FILE_BYTES == 256 << 20
    assert reader_module.READ_AHEAD_FILE_BYTES <= reader_module.READ_AHEAD_BUDGET
    root = save(tmp_path / "ckpt")
    files = {f.name: f.stat().st_size for f in data_files(root)}
    big = max(files, key=files.get)  # the embedding's file, twice a layer's
    monkeypatch.setattr(reader_module, "READ_AHEAD_FILE_BYTES", files[big] - 1)
    reads = record_reads_ahead(monkeypatch)
    got = load(tmp_path / "ckpt")
    assert all(torch.equal(got[k], v) for k, v in state().items())
    assert sorted(reads) == sorted(set(files) - {big})


@settings(max_examples=60, deadline=None)
@given(
    shape=st.lists(st.integers(1, 5), min_size=0, max_size=3),
    data=st.data(),
    chunk_items=st.integers(1, 40),
    dtype=st.sampled_from([torch.float32, torch.int16, torch.float64]),
)
def test_a_region_copied_through_a_chunk_equals_narrow(
    tmp_path_factory, shape, data, chunk_items, dtype
):
    """The streamed copy against ``tensor.narrow``: any shape, any region, chunks smaller than
    a row (so a row is split one dimension down) or holding several rows."""
    offsets = [data.draw(st.integers(0, n - 1)) for n in shape]
    lengths = [data.draw(st.integers(1, n - o)) for n, o in zip(shape, offsets, strict=True)]
    stored = (torch.arange(max(1, torch.Size(shape).numel())) * 3 + 1).to(dtype).view(shape)
    path = tmp_path_factory.mktemp("region") / "bytes"
    pad = 7  # the tensor starts at an odd offset in the file, as in a DCP archive
    path.write_bytes(b"x" * pad + stored.numpy().tobytes())
    target = torch.full(lengths, -5).to(dtype)
    with path.open("rb", buffering=0) as stream:
        source = reader_module._FileBytes(path, stream=stream)
        chunk = bytearray(chunk_items * dtype.itemsize)
        reader_module._copy_region(source, pad, shape, dtype, offsets, lengths, target, chunk)
    assert torch.equal(target, reader_module._narrow(stored, offsets, lengths))


# -- a save publishing over the path during a load -------------------------------------------

PUBLISH = textwrap.dedent(
    """
    import sys, torch, torch.distributed.checkpoint as dcp
    from fsdp_ext.checkpoint import SpreadFileSystemWriter, SpreadSavePlanner
    state = {f"layers.{i}.w": torch.full((64, 32), 7.0) for i in range(6)}
    state["embed"] = torch.full((128, 32), 7.0)
    dcp.save(state, storage_writer=SpreadFileSystemWriter(sys.argv[1], min_file_bytes=0),
             planner=SpreadSavePlanner())
    """
)


class _PublishAfterOpening(VerifiedFileSystemReader):
    """Rank 0: opens the checkpoint and reads its metadata, then another process saves over
    the path and publishes."""

    def read_metadata(self):
        metadata = super().read_metadata()
        subprocess.run([sys.executable, "-c", PUBLISH, str(self.path)], check=True, timeout=120)
        Path(f"{self.path}.published").touch()
        return metadata


class _OpenAfterPublish(VerifiedFileSystemReader):
    """Rank 1: opens the checkpoint only once the other save has published."""

    def read_metadata(self):
        deadline = time.monotonic() + 120
        while not Path(f"{self.path}.published").exists():
            assert time.monotonic() < deadline, "the publishing save never finished"
            time.sleep(0.05)
        return super().read_metadata()


def _load_across_a_publish(path: str) -> str | None:
    got = {k: torch.zeros_like(v) for k, v in state().items()}
    reader = (_PublishAfterOpening if dist.get_rank() == 0 else _OpenAfterPublish)(path)
    try:
        dcp.load(got, storage_reader=reader, planner=SafeLoadPlanner())
    except CheckpointException as exc:
        return str(exc)
    old = all(torch.equal(got[k], v) for k, v in state().items())
    new = all(bool((v == 7.0).all()) for v in got.values())
    return "loaded the old checkpoint" if old else "loaded the new" if new else "MIXED"


def test_a_load_across_a_publish_is_refused_not_mixed(tmp_path):
    """Rank 0 opened the old version, rank 1 the new one: the load must stop, saying so,
    before any data is read (the old version is gone by then too: had both ranks opened it
    first, both would fail saying it was removed while being read)."""
    save(tmp_path / "ckpt")
    try:
        results = run_distributed(_load_across_a_publish, 2, str(tmp_path / "ckpt"), timeout=240)
    except RankError as exc:  # pragma: no cover - shows what went wrong
        pytest.fail(str(exc))
    for error in results:
        assert error is not None and "the ranks opened different versions of it" in error, error
