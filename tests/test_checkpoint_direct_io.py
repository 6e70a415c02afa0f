"""Checkpoint data files written around the page cache (``O_DIRECT``): the bytes on disk are
exactly those written, the page cache does not hold them (``fincore``, from outside), the
checkpoint loads equal, and a filesystem without a block device gets buffered files."""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from fsdp_ext.checkpoint import SpreadFileSystemWriter, SpreadSavePlanner, verify_checkpoint
from fsdp_ext.checkpoint.direct_file import BLOCK, DirectFile, open_direct
from fsdp_ext.checkpoint.fs import DIRECT_IO_ENV, LocalStorage

MIB = 1 << 20


def _on_block_device(path: Path) -> bool:
    return os.major(os.stat(path).st_dev) != 0


def _resident_bytes(path: Path) -> int:
    """The file's bytes in the page cache, as util-linux's ``fincore`` reads them (mincore)."""
    out = subprocess.run(
        ["fincore", "--bytes", "--noheadings", "--raw", "--output", "RES", str(path)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return int(out.split()[0])


def _open_flags(fd: int) -> int:
    for line in Path(f"/proc/self/fdinfo/{fd}").read_text().splitlines():
        if line.startswith("flags:"):
            return int(line.split()[1], 8)
    raise AssertionError("no flags line in fdinfo")


def test_a_direct_file_holds_exactly_the_bytes_written(tmp_path):
    """Chunks of every awkward size (empty, one byte, one block, across the bounce buffer),
    from bytes and from tensors' memory: the file is their concatenation, and ``tell``
    says where each begins (what a checkpoint's item offsets are)."""
    rng = random.Random(0)
    sizes = [0, 1, BLOCK - 1, BLOCK, BLOCK + 1, 3, 4 * MIB + 3, 5 * MIB - 7, 64, 1, 2 * MIB]
    chunks = [rng.randbytes(n) for n in sizes]
    chunks.append(memoryview(torch.arange(300_001, dtype=torch.float32).numpy()).cast("B"))
    path = tmp_path / "data.bin"
    stream = open_direct(path)
    assert isinstance(stream, DirectFile)
    assert _open_flags(stream.fileno()) & os.O_DIRECT
    starts, expected = [], bytearray()
    for chunk in chunks:
        starts.append(stream.tell())
        assert stream.write(chunk) == len(bytes(chunk))
        expected += bytes(chunk)
    assert starts == [sum(len(bytes(c)) for c in chunks[:i]) for i in range(len(chunks))]
    stream.close()
    assert stream.direct  # tmp_path's filesystem took every write direct
    assert path.stat().st_size == len(expected)
    assert path.read_bytes() == bytes(expected)


def test_a_large_tensor_goes_to_the_device_from_its_own_memory(tmp_path):
    """After the zeros ``gap_before`` asks for, a tensor's bytes are not copied (only its
    first partial block and its tail are), and the file holds header, tensor, tail."""
    tensor = torch.randn(3 * MIB + 5)  # 12 MiB and 20 bytes
    payload = memoryview(tensor.numpy()).cast("B")
    header, tail = b"h" * 100, b"t" * 30
    stream = open_direct(tmp_path / "data.bin")
    stream.write(b"x" * 7)
    gap = stream.gap_before(payload, len(header))
    assert 0 <= gap < BLOCK
    stream.write(bytes(gap))
    start = stream.tell() + len(header)
    stream.write(header)
    stream.write(payload)
    stream.write(tail)
    stream.close()
    assert stream.direct  # every write went to the device whole-block aligned
    # its first partial block and its last one: not the 12 MiB
    assert stream.copied < 7 + gap + len(header) + 2 * BLOCK + len(tail)
    data = (tmp_path / "data.bin").read_bytes()
    assert data[start : start + payload.nbytes] == payload.tobytes()
    assert data[:7] == b"x" * 7 and data[start - 100 : start] == header and data[-30:] == tail
    # a read-only buffer, or a write too small to be worth it, is copied
    assert open_direct(tmp_path / "b").gap_before(memoryview(bytes(MIB)), 0) == 0
    assert open_direct(tmp_path / "c").gap_before(payload[: BLOCK * 2], 0) == 0


def _state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {f"layers.{i}.w": torch.randn(1024, 1024) for i in range(4)}  # 16 MiB


def _save(path: Path) -> list[Path]:
    dcp.save(_state(), storage_writer=SpreadFileSystemWriter(path), planner=SpreadSavePlanner())
    return sorted(Path(os.path.realpath(path)).glob("*.distcp"))


def test_a_checkpoint_saved_on_a_block_device_stays_out_of_the_page_cache(tmp_path, monkeypatch):
    if not _on_block_device(tmp_path):
        pytest.skip(f"{tmp_path} is on no block device: data files are written buffered there")
    if shutil.which("fincore") is None:
        pytest.skip("needs util-linux's fincore")
    files = _save(tmp_path / "direct")
    data = sum(f.stat().st_size for f in files)
    assert data > 16 * MIB
    assert sum(_resident_bytes(f) for f in files) == 0
    got = {k: torch.zeros_like(v) for k, v in _state().items()}
    dcp.load(got, checkpoint_id=tmp_path / "direct")
    assert all(torch.equal(got[k], v) for k, v in _state().items())
    assert verify_checkpoint(tmp_path / "direct").ok

    # the control: buffered, the same files are in the page cache (the measure sees them)
    monkeypatch.setenv(DIRECT_IO_ENV, "0")
    buffered = _save(tmp_path / "buffered")
    assert sum(_resident_bytes(f) for f in buffered) >= data // 2
    # the same items: direct files differ only by the zeros put before large tensors so
    # that the device reads them from the tensors' own memory (under one block each)
    padding = data - sum(f.stat().st_size for f in buffered)
    assert 0 <= padding < BLOCK * len(_state())


def test_direct_io_is_chosen_per_filesystem(tmp_path, monkeypatch):
    """Default: only where a block device is under the directory (tmpfs at /dev/shm: its
    st_dev major is 0); ``1`` forces it wherever the filesystem takes it, ``0`` never."""
    shm = Path("/dev/shm")
    if not shm.is_dir() or _on_block_device(shm):
        pytest.skip("needs a tmpfs at /dev/shm")
    target = shm / f"fsdp-ext-direct-{os.getpid()}"
    monkeypatch.delenv(DIRECT_IO_ENV, raising=False)
    try:
        for env, kwargs, expected in [
            (None, {}, False),
            ("1", {}, True),
            ("1", {"direct_io": False}, False),
            (None, {"direct_io": True}, True),
        ]:
            if env is None:
                monkeypatch.delenv(DIRECT_IO_ENV, raising=False)
            else:
                monkeypatch.setenv(DIRECT_IO_ENV, env)
            stream = LocalStorage(**kwargs).open_data_write(target)
            stream.write(b"x" * 10)
            stream.close()
            assert isinstance(stream, DirectFile) == expected, (env, kwargs)
            assert target.read_bytes() == b"x" * 10
        if _on_block_device(tmp_path):
            monkeypatch.delenv(DIRECT_IO_ENV, raising=False)
            stream = LocalStorage().open_data_write(tmp_path / "f")
            stream.close()
            assert isinstance(stream, DirectFile)
    finally:
        target.unlink(missing_ok=True)


def test_direct_io_is_none_true_or_false():
    with pytest.raises(TypeError, match="direct_io must be None"):
        LocalStorage(direct_io="yes")


def test_a_forked_child_writes_through_bounce_buffers_of_its_own(tmp_path):
    """The bounce buffers kept for reuse are private memory: a child forked after the parent
    wrote (a data loader's worker, a launcher's fork) and the parent, writing at once, do not
    write into each other's buffer."""
    stream = open_direct(tmp_path / "warm")
    stream.write(b"w" * 10)
    stream.close()  # its bounce buffer is kept for the next file, in this process
    to_parent, to_child = os.pipe(), os.pipe()  # (read end, write end) each
    pid = os.fork()
    if pid == 0:  # the child: fill a file with "c" through the kept buffer
        try:
            child = open_direct(tmp_path / "child")
            child.write(b"c" * 3000)
            os.write(to_parent[1], b"1")
            os.read(to_child[0], 1)  # the parent has written its "p" meanwhile
            child.write(b"c" * 3000)
            child.close()
        finally:
            os._exit(0)
    parent = open_direct(tmp_path / "parent")
    parent.write(b"p" * 3000)
    assert os.read(to_parent[0], 1) == b"1"
    parent.write(b"p" * 3000)
    os.write(to_child[1], b"1")
    parent.close()
    assert os.waitpid(pid, 0)[1] == 0
    assert (tmp_path / "child").read_bytes() == b"c" * 6000
    assert (tmp_path / "parent").read_bytes() == b"p" * 6000


def test_a_child_forked_while_another_thread_takes_a_bounce_buffer_can_write(tmp_path):
    """The lock around the kept bounce buffers, held by another thread at the fork, is free
    in the child: its first data file does not wait forever."""
    from fsdp_ext.checkpoint import direct_file

    with direct_file._spare_lock:  # what a writer thread holds for a moment
        pid = os.fork()
        if pid == 0:
            signal.alarm(20)  # a child stuck on the lock dies of SIGALRM
            try:
                stream = open_direct(tmp_path / "child")
                stream.write(b"c" * 10)
                stream.close()
            finally:
                os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, status
    assert (tmp_path / "child").read_bytes() == b"c" * 10
