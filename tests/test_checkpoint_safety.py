"""Damaged and hostile checkpoints: one clear error naming the file, and no code runs.

Single-process saves and loads (``dcp`` without a process group), so each case is cheap.
Where the stock reader behaves differently, the test shows that too.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import warnings
import zlib
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from fsdp_ext._torch import DCP_LOAD_DROPS_METADATA_ERRORS
from fsdp_ext.checkpoint import (
    CheckpointIntegrityError,
    SafeLoadPlanner,
    SpreadFileSystemWriter,
    SpreadSavePlanner,
    UnsafeCheckpointError,
    VerifiedFileSystemReader,
    verify_checkpoint,
)
from fsdp_ext.checkpoint.__main__ import main as cli
from fsdp_ext.checkpoint.manifest import SELF_CHECKSUM, seal
from fsdp_ext.checkpoint.unpickler import load_metadata
from tests.dcp_errors import error_text, logged_metadata_errors

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def state(seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {
        "layers.0.w": torch.randn(64, 32, generator=gen),
        "layers.1.w": torch.randn(64, 32, generator=gen),
        "embed": torch.randn(128, 32, generator=gen),
        "step": 3,
    }


def zeros() -> dict:
    return {k: torch.zeros_like(v) if torch.is_tensor(v) else 0 for k, v in state().items()}


def save(path: Path, sd: dict | None = None) -> Path:
    dcp.save(
        sd or state(),
        storage_writer=SpreadFileSystemWriter(path, min_file_bytes=0),  # a file per layer
        planner=SpreadSavePlanner(),
    )
    return path


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    return save(tmp_path_factory.mktemp("ckpt") / "good")


@pytest.fixture
def ckpt(pristine, tmp_path) -> Path:
    copy = tmp_path / "ckpt"
    shutil.copytree(pristine, copy)
    return copy


def load_ours(path: Path, planner=None) -> dict:
    target = zeros()
    dcp.load(
        target, storage_reader=VerifiedFileSystemReader(path), planner=planner or SafeLoadPlanner()
    )
    return target


def cause(excinfo) -> BaseException:
    """DCP wraps a rank's error in CheckpointException (a BaseException); unwrap it.

    An error reading ``.metadata`` reaches the user as DCP's own AssertionError whose one
    line ends with ours, so there the message is what counts.
    """
    err = excinfo.value
    if isinstance(err, CheckpointException):
        (err, _trace), *_ = err.failures.values()
    return err


def metadata_error(path: Path) -> BaseException:
    """What our reader raises on .metadata, before dcp.load rewraps it."""
    with pytest.raises((CheckpointIntegrityError, UnsafeCheckpointError)) as err:
        VerifiedFileSystemReader(path).read_metadata()
    return err.value


def largest_tensor_region(path: Path) -> tuple[Path, int]:
    meta = load_metadata((path / ".metadata").read_bytes(), "m")
    index = max(meta.storage_data, key=lambda i: meta.storage_data[i].length)
    info = meta.storage_data[index]
    return path / info.relative_path, info.offset + info.length // 2


def flip(path: Path) -> Path:
    file, at = largest_tensor_region(path)
    data = bytearray(file.read_bytes())
    data[at] ^= 0x40
    file.write_bytes(bytes(data))
    return file


def truncate(path: Path) -> Path:
    file, _ = largest_tensor_region(path)
    file.write_bytes(file.read_bytes()[:-100])
    return file


def delete(path: Path) -> Path:
    file, _ = largest_tensor_region(path)
    file.unlink()
    return file


def delete_metadata(path: Path) -> Path:
    (path / ".metadata").unlink()
    return path / ".metadata"


def corrupt_metadata(path: Path) -> Path:
    data = bytearray((path / ".metadata").read_bytes())
    data[len(data) // 2] ^= 0x01
    (path / ".metadata").write_bytes(bytes(data))
    return path / ".metadata"


def delete_manifest(path: Path) -> Path:
    (path / ".manifest.json").unlink()
    return path / ".manifest.json"


DAMAGE = {
    flip: "expects",
    truncate: "bytes, the manifest expects",
    delete: "missing",
    delete_metadata: "missing",
    corrupt_metadata: "expects",
    delete_manifest: "missing",
}


@pytest.mark.parametrize("damage", list(DAMAGE), ids=lambda f: f.__name__)
def test_damage_gives_one_error_naming_the_file(ckpt, damage, caplog):
    file = damage(ckpt)
    with pytest.raises(CheckpointException) as err:
        load_ours(ckpt)
    error = cause(err)
    message = str(error)
    if DCP_LOAD_DROPS_METADATA_ERRORS and message == "metadata is None":
        # 2.11's dcp.load drops the reader's error; the reader logs it, worded as 2.13's
        (message,) = [r.getMessage() for r in caplog.records if r.name == "fsdp_ext._torch"]
    assert "\n" not in message and f"{file}: " in message, message
    if file.name.startswith("__"):
        assert isinstance(error, CheckpointIntegrityError)
    else:
        assert message.startswith("metadata is None; global metadata read failed: ")
        assert (
            isinstance(metadata_error(ckpt), CheckpointIntegrityError) and DAMAGE[damage] in message
        ), message
    # verify_checkpoint names the same file without loading anything
    report = verify_checkpoint(ckpt)
    assert not report.ok
    assert any(str(file) in p for p in report.problems), report.problems


def test_flipped_byte_loads_silently_wrong_with_the_stock_reader(ckpt):
    """The contrast the docs show: stock DCP has no integrity check."""
    flip(ckpt)
    target = zeros()
    dcp.load(target, storage_reader=dcp.FileSystemReader(ckpt))
    wrong = [k for k, v in state().items() if torch.is_tensor(v) and not torch.equal(v, target[k])]
    assert len(wrong) == 1


def test_a_sound_checkpoint_loads_and_verifies(ckpt, capsys):
    loaded = load_ours(ckpt)
    assert all(
        torch.equal(v, loaded[k]) if torch.is_tensor(v) else v == loaded[k]
        for k, v in state().items()
    )
    assert cli(["verify", str(ckpt)]) == 0
    assert cli(["inspect", str(ckpt)]) == 0
    out = capsys.readouterr().out
    assert "__0_layers.1.distcp  0" in out and "layers.1" in out
    flip(ckpt)
    corrupt_metadata(ckpt)
    assert cli(["verify", str(ckpt)]) == 1
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 3, lines  # one line per problem, then the summary
    assert "__0_other.distcp: crc32" in lines[0] and ".metadata: crc32" in lines[1]
    assert "2 problem(s)" in lines[2]


def test_stock_checkpoint_loads_with_one_warning(tmp_path):
    dcp.save(state(), storage_writer=dcp.FileSystemWriter(tmp_path / "stock"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = load_ours(tmp_path / "stock")
    ours = [w for w in caught if "without size and checksum verification" in str(w.message)]
    assert len(ours) == 1
    assert torch.equal(loaded["embed"], state()["embed"])


# -- untrusted input -----------------------------------------------------------------------


class Payload:
    """Unpickling this runs ``os.system("touch MARKER")``."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_crafted_metadata_is_refused_and_runs_nothing(ckpt, tmp_path):
    marker = tmp_path / "pwned"
    evil = pickle.dumps(Payload(marker))
    (ckpt / ".metadata").write_bytes(evil)
    # whoever can write .metadata can write the manifest too: make the checksum match
    manifest = json.loads((ckpt / ".manifest.json").read_text())
    manifest["metadata"].update(size=len(evil), checksum=f"{zlib.crc32(evil):08x}")
    (ckpt / ".manifest.json").write_text(seal(manifest, SELF_CHECKSUM))
    with logged_metadata_errors() as logged, pytest.raises(CheckpointException) as err:
        load_ours(ckpt)
    assert "refuses to load the pickle global posix.system" in error_text(cause(err), logged)
    assert "posix.system" in str(metadata_error(ckpt))
    assert isinstance(metadata_error(ckpt), UnsafeCheckpointError)
    report = verify_checkpoint(ckpt)
    assert any("posix.system" in p for p in report.problems)
    assert not marker.exists()
    # the stock reader runs it
    with pytest.raises(CheckpointException):  # it then fails on what it got back
        dcp.load(zeros(), storage_reader=dcp.FileSystemReader(ckpt))
    assert marker.exists()


def test_crafted_item_is_refused_and_runs_nothing(tmp_path):
    marker = tmp_path / "pwned"
    path = save(tmp_path / "ckpt", {**state(), "evil": Payload(marker)})
    assert verify_checkpoint(path).ok  # consistent files: the checksums cannot help here
    for planner in (SafeLoadPlanner(), None):
        target = {**zeros(), "evil": None}
        reader = VerifiedFileSystemReader(path)
        kwargs = {"planner": planner} if planner else {}
        with pytest.raises(CheckpointException) as err:
            dcp.load(target, storage_reader=reader, **kwargs)
        assert isinstance(cause(err), UnsafeCheckpointError)
        assert "item evil: refused to unpickle" in str(cause(err))
        assert not marker.exists()
    # the stock reader with the default planner runs it
    dcp.load({**zeros(), "evil": None}, storage_reader=dcp.FileSystemReader(path))
    assert marker.exists()


def test_overwrite_publishes_the_new_checkpoint_whole(tmp_path):
    """Saving over a checkpoint swaps the new version in (a real directory here, on ext4 or
    tmpfs): new values, the old version removed, nothing else beside it."""
    path = save(tmp_path / "ckpt", state(seed=0))
    first = verify_checkpoint(path)
    save(path, state(seed=1))
    loaded = load_ours(path)
    assert torch.equal(loaded["embed"], state(seed=1)["embed"])
    report = verify_checkpoint(path)
    assert report.ok and report.notes == []
    assert report.save_id != first.save_id and report.version is None
    assert path.is_dir() and not path.is_symlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    with pytest.raises(CheckpointException) as err:  # overwrite=False refuses before writing
        dcp.save(
            state(seed=2),
            storage_writer=SpreadFileSystemWriter(path, overwrite=False),
            planner=SpreadSavePlanner(),
        )
    assert "overwrite=False" in str(cause(err))
    assert torch.equal(load_ours(path)["embed"], state(seed=1)["embed"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_files_are_layer_runs_and_one_per_writer_thread(tmp_path):
    """min_file_bytes merges layers into runs; thread_count splits until each thread has one."""
    merged = tmp_path / "merged"
    dcp.save(state(), storage_writer=SpreadFileSystemWriter(merged), planner=SpreadSavePlanner())
    assert sorted(verify_checkpoint(merged).files) == ["__0_other..layers.1.distcp"]
    threaded = tmp_path / "threaded"
    writer = SpreadFileSystemWriter(threaded, thread_count=3)
    dcp.save(state(), storage_writer=writer, planner=SpreadSavePlanner())
    report = verify_checkpoint(threaded)
    assert report.ok and len(report.files) == 3
    assert torch.equal(load_ours(threaded)["layers.1.w"], state()["layers.1.w"])


def test_writer_threads_get_halves_of_the_bytes(tmp_path):
    """thread_count=2: the rank's one layer run is halved by bytes, so each thread writes
    about half of the data (file sizes on disk), not one thread all of it."""
    path = tmp_path / "ckpt"
    writer = SpreadFileSystemWriter(path, thread_count=2)
    dcp.save(state(), storage_writer=writer, planner=SpreadSavePlanner())
    report = verify_checkpoint(path)
    sizes = [os.stat(path / name).st_size for name in report.files]
    assert len(sizes) == 2 and min(sizes) / max(sizes) > 0.8, sizes
    assert all(record.items >= 1 for record in report.files.values())


def test_every_file_is_fsynced_before_the_publish(tmp_path, monkeypatch):
    """Durability: data files, .metadata, the manifest and the version directory reach the
    disk before the rename publishes them, and the parent dir after it (so the rename
    persists). Seen by wrapping os.fsync and os.replace, outside the library."""
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(src, dst):
        events.append(("rename", str(dst)))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    path = save(tmp_path / "ckpt")
    publish = events.index(("rename", str(path)))
    synced = [Path(p).name for kind, p in events[:publish] if kind == "fsync"]
    # the version directory, fsynced under its own name, then renamed onto the path
    version = next(n for n in synced if n.startswith(".ckpt.v-"))
    on_disk = {p.name for p in path.iterdir()}
    data = {name for name in on_disk if name.endswith(".distcp")}
    assert len(data) == 3 and on_disk == data | {".metadata", ".manifest.json"}
    assert data | {".manifest.json.tmp", ".metadata", version} <= set(synced)
    assert path.is_dir() and not path.is_symlink()
    assert ("fsync", str(tmp_path)) in events[publish:]
