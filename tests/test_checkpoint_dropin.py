"""A drop-in for stock DCP: the path is a real directory, foreign files are kept, what stock
loads loads (safely), stock signatures and errors, crash-safe pruning.

Each test does what a user does from outside: ``TemporaryDirectory``, ``shutil.rmtree``,
``cp -r`` in a subprocess, a ``model.pt`` beside the checkpoint, a checkpoint of an older
torch, NumPy's RNG state, a SIGKILL at every filesystem call of a prune.
"""

from __future__ import annotations

import argparse
import copyreg
import datetime
import multiprocessing as mp
import os
import pickle
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path
from unittest.mock import patch

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed._shard.sharded_tensor.metadata import TensorProperties as LegacyProperties
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import create_default_local_save_plan

from fsdp_ext.checkpoint import (
    CheckpointIntegrityError,
    LocalStorage,
    SafeLoadPlanner,
    SpreadFileSystemWriter,
    SpreadSavePlanner,
    UnsafeCheckpointError,
    VerifiedFileSystemReader,
    remove_checkpoint,
    verify_checkpoint,
)
from fsdp_ext.checkpoint.unpickler import ALLOWED_OPCODES
from tests.dcp_errors import error_text, logged_metadata_errors

pytestmark = pytest.mark.filterwarnings(
    "ignore:torch.distributed is disabled", "ignore:.*no .manifest.json", "ignore:Detected an"
)

_fork = mp.get_context("fork")


def state(seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {
        "layers.0.w": torch.randn(16, 8, generator=gen),
        "layers.1.w": torch.randn(16, 8, generator=gen),
        "embed": torch.randn(32, 8, generator=gen),
        "step": seed,
    }


def save(path, seed: int, fs: LocalStorage | None = None, **kwargs) -> None:
    dcp.save(
        state(seed),
        storage_writer=SpreadFileSystemWriter(path, min_file_bytes=0, fs=fs, **kwargs),
        planner=SpreadSavePlanner(),
    )


def loads(path, seed: int) -> bool:
    """Our reader and the stock one both load exactly the values of ``seed``."""
    want = state(seed)
    for reader, planner in (
        (VerifiedFileSystemReader(path), SafeLoadPlanner()),
        (dcp.FileSystemReader(path), None),
    ):
        got = {k: torch.zeros_like(v) if torch.is_tensor(v) else -1 for k, v in want.items()}
        dcp.load(got, storage_reader=reader, planner=planner)
        for k, v in want.items():
            if not (torch.equal(v, got[k]) if torch.is_tensor(v) else v == got[k]):
                return False
    return True


def entries(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def cause(excinfo) -> BaseException:
    err = excinfo.value
    if isinstance(err, CheckpointException):
        (err, _trace), *_ = err.failures.values()
    return err


# -- the path is a real directory ----------------------------------------------------------


def test_a_save_in_a_temporary_directory_leaves_nothing(tmp_path):
    with tempfile.TemporaryDirectory(dir=tmp_path) as d:
        save(d, seed=0)
        save(d, seed=1)  # an overwrite: a swap, the old version removed
        assert Path(d).is_dir() and not Path(d).is_symlink()
        assert loads(d, seed=1)
        assert entries(tmp_path) == [Path(d).name]  # no lock, version or trash beside it
    assert entries(tmp_path) == []  # TemporaryDirectory's own rmtree worked


def test_rmtree_and_cp_r_work_on_a_checkpoint(tmp_path):
    path = tmp_path / "ckpt"
    save(path, seed=0)
    save(path, seed=1)
    copy = tmp_path / "copy"
    subprocess.run(["cp", "-r", str(path), str(copy)], check=True, timeout=60)
    assert loads(copy, seed=1) and verify_checkpoint(copy).ok
    save(copy, seed=2)  # the copy is a checkpoint of its own: saving over it works
    assert loads(copy, seed=2) and loads(path, seed=1)
    shutil.rmtree(path)
    assert sorted(entries(tmp_path)) == ["copy"]


# -- foreign files ---------------------------------------------------------------------------


def test_files_we_did_not_write_are_kept_and_saved_beside(tmp_path):
    path = tmp_path / "run"
    path.mkdir()
    (path / "model.pt").write_bytes(b"user bytes")
    (path / "notes").mkdir()
    (path / "notes" / "a.txt").write_text("mine")
    save(path, seed=0)
    assert loads(path, seed=0) and verify_checkpoint(path).ok
    first = set(entries(path))
    save(path, seed=1)
    assert loads(path, seed=1) and verify_checkpoint(path).ok
    assert (path / "model.pt").read_bytes() == b"user bytes"
    assert (path / "notes" / "a.txt").read_text() == "mine"
    ours = set(entries(path)) - {"model.pt", "notes"}
    # the first save's data files went once the second was committed; nothing else beside
    assert ours == {".metadata", ".manifest.json", *verify_checkpoint(path).files}
    assert not (ours - {".metadata", ".manifest.json"}) & first
    assert entries(tmp_path) == ["run"]


def test_a_stock_checkpoint_is_overwritten_in_place_as_stock_does(tmp_path):
    path = tmp_path / "ckpt"
    dcp.save(state(0), storage_writer=dcp.FileSystemWriter(path))
    stock_files = set(entries(path)) - {".metadata"}
    save(path, seed=1)
    assert loads(path, seed=1) and verify_checkpoint(path).ok
    assert stock_files <= set(entries(path))  # never moved or deleted
    dcp.save(state(2), storage_writer=dcp.FileSystemWriter(path))  # and stock over ours
    got = {k: torch.zeros_like(v) if torch.is_tensor(v) else -1 for k, v in state(2).items()}
    dcp.load(got, storage_reader=dcp.FileSystemReader(path))
    assert torch.equal(got["embed"], state(2)["embed"])


class KillAt(LocalStorage):
    """SIGKILLs its own process just before operation number ``at`` (0-based)."""

    def __init__(self, at: int):
        super().__init__()
        self.at = at
        self.count = 0
        self.ops: list[tuple[str, str]] = []

    def before(self, op, path):
        if self.count == self.at:
            os.kill(os.getpid(), signal.SIGKILL)
        self.count += 1
        self.ops.append((op, Path(path).name))


def run_child(fn, *args) -> int:
    proc = _fork.Process(target=fn, args=args)
    proc.start()
    proc.join(60)
    assert not proc.is_alive()
    return proc.exitcode


def test_sigkill_at_every_step_of_an_in_place_save(tmp_path):
    """Beside a foreign file, a kill anywhere leaves the old or the new checkpoint for the
    stock reader; ours loads the same, except between the manifest's rename and the
    metadata's (stock's commit point), where it names the mismatch; the next save cleans
    up after the killed one, and the foreign file is never touched."""
    rehearsal = tmp_path / "rehearsal"
    rehearsal.mkdir()
    (rehearsal / "model.pt").write_bytes(b"user")
    save(rehearsal, seed=0)
    recording = KillAt(-1)
    save(rehearsal, seed=1, fs=recording)
    ops = recording.ops
    commit = ops.index(("rename", ".metadata"))
    assert ops[commit - 1] == ("rename", ".manifest.json")
    for k in range(len(ops) + 1):
        path = tmp_path / f"kill{k}"
        path.mkdir()
        (path / "model.pt").write_bytes(b"user")
        save(path, seed=0)
        code = run_child(save, path, 1, KillAt(k))
        assert code == (-signal.SIGKILL if k < len(ops) else 0), (k, code)
        which = 0 if k <= commit else 1
        stock = {
            key: torch.zeros_like(v) if torch.is_tensor(v) else -1 for key, v in state(0).items()
        }
        dcp.load(stock, storage_reader=dcp.FileSystemReader(path))
        assert torch.equal(stock["embed"], state(which)["embed"]), k
        if k == commit:
            with pytest.raises(CheckpointIntegrityError, match="manifest expects"):
                VerifiedFileSystemReader(path).read_metadata()
        else:
            assert loads(path, seed=which), k
        assert (path / "model.pt").read_bytes() == b"user"
        save(path, seed=2)
        report = verify_checkpoint(path)
        assert report.ok and loads(path, seed=2), (k, report.problems)
        assert entries(path) == sorted(["model.pt", ".metadata", ".manifest.json", *report.files])
        assert entries(tmp_path) == sorted(["rehearsal", *(f"kill{i}" for i in range(k + 1))])


# -- stock signatures and errors -------------------------------------------------------------


def test_overwrite_false_raises_stocks_error_and_message(tmp_path):
    messages = []
    for writer in (dcp.FileSystemWriter, SpreadFileSystemWriter):
        path = tmp_path / writer.__name__
        dcp.save(state(0), storage_writer=writer(path))
        with pytest.raises(CheckpointException) as err:
            dcp.save(state(1), storage_writer=writer(path, overwrite=False))
        assert isinstance(cause(err), RuntimeError)
        messages.append(str(cause(err)))
        assert loads(path, seed=0)
    assert messages[1].startswith(messages[0]) and "overwrite=False" in messages[0]


def test_stock_positional_arguments_and_keywords_are_accepted(tmp_path):
    # FileSystemWriter(path, single_file_per_rank, sync_files, thread_count,
    # per_thread_copy_ahead, cache_staged_state_dict, overwrite)
    writer = SpreadFileSystemWriter(tmp_path / "a", True, True, 2, 1 << 20, False, True)
    assert (writer.thread_count, writer.per_thread_copy_ahead, writer.overwrite) == (
        2,
        1 << 20,
        True,
    )
    dcp.save(state(0), storage_writer=writer, planner=SpreadSavePlanner(True, True))
    assert loads(tmp_path / "a", seed=0)
    # single_file_per_rank=False: one file per layer per rank, the finest split we make
    dcp.save(state(0), storage_writer=SpreadFileSystemWriter(tmp_path / "b", False))
    assert sorted(verify_checkpoint(tmp_path / "b").files) == [
        "__0_layers.0.distcp",
        "__0_layers.1.distcp",
        "__0_other.distcp",
    ]
    dcp.save(state(0), storage_writer=SpreadFileSystemWriter(tmp_path / "c"))
    assert len(verify_checkpoint(tmp_path / "c").files) == 1
    reader = VerifiedFileSystemReader(tmp_path / "a", None)
    got = {k: torch.zeros_like(v) if torch.is_tensor(v) else -1 for k, v in state(0).items()}
    dcp.load(got, storage_reader=reader, planner=SafeLoadPlanner(True, True, False))
    assert torch.equal(got["embed"], state(0)["embed"])


def test_plan_caching_is_accepted_with_a_warning_that_says_it_changes_nothing(tmp_path):
    with pytest.warns(UserWarning, match="changes nothing"):
        planner = SpreadSavePlanner(enable_plan_caching=True)
    for seed in (0, 1, 2):  # repeated saves: a cached plan would name a removed version
        dcp.save(state(seed), storage_writer=SpreadFileSystemWriter(tmp_path), planner=planner)
        assert loads(tmp_path, seed)


def test_dedup_save_to_lowest_rank_gives_stocks_placement():
    shared = {"w": torch.zeros(64, 8), "v": torch.zeros(32, 8)}
    plans = [create_default_local_save_plan(shared, rank == 0) for rank in range(2)]
    spread = SpreadSavePlanner().dedup_plans(plans)
    lowest = SpreadSavePlanner(dedup_save_to_lowest_rank=True).dedup_plans(plans)
    assert [len(p.items) for p in lowest] == [2, 0]
    assert all(len(p.items) >= 1 for p in spread)


# -- what stock loads, safely ---------------------------------------------------------------


def test_metadata_of_older_torch_releases_loads(tmp_path):
    """Before 2.4, DCP metadata named its tensor properties from the sharded-tensor module
    (PyTorch's test_compatibility.py::test_sharded_tensor_dependency)."""
    with patch("torch.distributed.checkpoint.metadata.TensorProperties", LegacyProperties):
        dcp.save(state(0), storage_writer=dcp.FileSystemWriter(tmp_path / "stock"))
        save(tmp_path / "ours", seed=0)
    for path in (tmp_path / "stock", tmp_path / "ours"):
        assert b"sharded_tensor.metadata" in (path / ".metadata").read_bytes()
        assert loads(path, seed=0)
    assert verify_checkpoint(tmp_path / "ours").ok


class Point:
    """A user's type: refused until the user allows it the standard torch way."""

    def __init__(self, x: int):
        self.x = x

    def __eq__(self, other):
        return isinstance(other, Point) and other.x == self.x


def extras() -> dict:
    np.random.seed(3)
    return {
        "np_rng": np.random.get_state(),
        "when": datetime.datetime(2026, 11, 26, 9, 30, tzinfo=datetime.timezone.utc),
        "args": argparse.Namespace(lr=0.1, layers=[1, 2]),
        "array": np.arange(6, dtype=np.float32).reshape(2, 3),
    }


def equal(a, b) -> bool:
    if isinstance(a, tuple):
        return len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and np.array_equal(a, b)
    return a == b


def test_numpy_rng_datetime_and_namespace_round_trip(tmp_path):
    dcp.save({**state(0), **extras()}, storage_writer=SpreadFileSystemWriter(tmp_path))
    for planner in (SafeLoadPlanner(), None):  # ours, and the stock planner behind our reader
        got = {**state(1), **dict.fromkeys(extras())}
        dcp.load(got, storage_reader=VerifiedFileSystemReader(tmp_path), planner=planner)
        assert all(equal(v, got[k]) for k, v in extras().items())
        np.random.set_state(got["np_rng"])
        np.random.seed(3)
        expected = np.random.rand(4)
        np.random.set_state(got["np_rng"])
        assert np.array_equal(np.random.rand(4), expected)  # resumes the same stream


def test_a_user_type_loads_once_allowed_the_torch_way(tmp_path):
    dcp.save({**state(0), "p": Point(7)}, storage_writer=SpreadFileSystemWriter(tmp_path))

    def load():
        got = {**state(1), "p": None}
        dcp.load(got, storage_reader=VerifiedFileSystemReader(tmp_path), planner=SafeLoadPlanner())
        return got["p"]

    with pytest.raises(CheckpointException) as err:
        load()
    message = str(cause(err))
    name = f"{__name__}.Point"
    assert isinstance(cause(err), UnsafeCheckpointError) and "\n" not in message
    assert f"the pickle global {name}" in message
    assert f"torch.serialization.add_safe_globals([{name}])" in message
    with torch.serialization.safe_globals([Point]):
        assert load() == Point(7)
    torch.serialization.add_safe_globals([Point])
    try:
        assert load() == Point(7)
    finally:
        torch.serialization.clear_safe_globals()


def test_metadata_globals_the_user_allowed_load():
    """The metadata unpickler honours the same torch mechanism, and says so in its refusal."""
    from fsdp_ext.checkpoint.unpickler import load_metadata

    stash = pickle.dumps({"x": Point(1)}, protocol=2)
    with pytest.raises(UnsafeCheckpointError) as err:
        load_metadata(stash, "m")
    assert f"add_safe_globals([{__name__}.Point])" in str(err.value)
    with torch.serialization.safe_globals([Point]), pytest.raises(UnsafeCheckpointError) as err:
        load_metadata(stash, "m")  # allowed, so unpickled; then not DCP Metadata
    assert "not DCP Metadata" in str(err.value)


EXT_CODE = 0x6A5E


class Payload:
    """Unpickling this runs ``os.system("touch MARKER")``."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.fixture
def warm_extension_cache():
    """``posix.system`` registered in copyreg's extension registry and already looked up
    once, so the C unpickler's EXT opcode hands it out from its cache, without find_class."""
    copyreg.add_extension("posix", "system", EXT_CODE)
    ext2 = b"\x80\x02\x83" + EXT_CODE.to_bytes(2, "little") + b"."
    assert pickle.loads(ext2) is os.system  # warms the cache; runs nothing
    yield ext2
    copyreg.remove_extension("posix", "system", EXT_CODE)


def ext_payload(marker: Path) -> bytes:
    command = f"touch {marker}".encode()
    return (
        b"\x80\x02\x83"
        + EXT_CODE.to_bytes(2, "little")
        + b"X"
        + len(command).to_bytes(4, "little")
        + command
        + b"\x85R."
    )


def test_ext_opcodes_are_refused_unrun_with_a_warm_extension_cache(tmp_path, warm_extension_cache):
    marker = tmp_path / "pwned"
    path = tmp_path / "stock"
    dcp.save(state(0), storage_writer=dcp.FileSystemWriter(path))
    (path / ".metadata").write_bytes(ext_payload(marker))
    report = verify_checkpoint(path)
    assert any("refuses the pickle opcode EXT2" in p for p in report.problems), report.problems
    with logged_metadata_errors() as logged, pytest.raises(CheckpointException) as err:
        dcp.load(state(1), storage_reader=VerifiedFileSystemReader(path))
    assert "refuses the pickle opcode EXT2" in error_text(err.value, logged)
    # an item pickled while the extension is registered: the pickler itself writes EXT2
    item_path = tmp_path / "item"
    dcp.save(
        {"x": torch.zeros(2), "evil": Payload(marker)},
        storage_writer=dcp.FileSystemWriter(item_path),
    )
    assert not marker.exists()
    for planner in (SafeLoadPlanner(), None):  # ours, and the stock planner behind our reader
        with pytest.raises(CheckpointException) as err:
            dcp.load(
                {"x": torch.ones(2), "evil": None},
                storage_reader=VerifiedFileSystemReader(item_path),
                planner=planner,
            )
        assert isinstance(cause(err), UnsafeCheckpointError)
        assert "item evil" in str(cause(err)) and "opcode EXT2" in str(cause(err))
    assert not marker.exists()
    assert "EXT1" not in ALLOWED_OPCODES and "EXT4" not in ALLOWED_OPCODES
    pickle.loads(ext_payload(marker))  # the payload is live: plain pickle runs it
    assert marker.exists()


# -- crash-safe pruning ----------------------------------------------------------------------


def prune_in_child(path: Path, at: int) -> None:
    remove_checkpoint(path, fs=KillAt(at))


@pytest.mark.parametrize("layout", ["swap", "link"])
def test_sigkill_at_every_step_of_a_prune_leaves_nothing_after_the_next_save(
    tmp_path, monkeypatch, layout
):
    if layout == "link":
        monkeypatch.setenv("FSDP_EXT_CHECKPOINT_SWAP", "0")
    rehearsal = tmp_path / "rehearsal"
    rehearsal.mkdir()
    save(rehearsal / "step-1", seed=0)
    save(rehearsal / "step-1", seed=1)
    recording = KillAt(-1)
    remove_checkpoint(rehearsal / "step-1", fs=recording)
    assert entries(rehearsal) == []
    ops = recording.ops
    assert ("remove_tree" in {op for op, _ in ops}) and len(ops) >= 6
    gone_at = None
    for k in range(len(ops)):
        root = tmp_path / f"kill{k}"
        root.mkdir()
        save(root / "step-1", seed=0)
        save(root / "step-1", seed=1)
        assert run_child(prune_in_child, root / "step-1", k) == -signal.SIGKILL, k
        save(root / "step-2", seed=2)  # the next save in the same directory
        report = verify_checkpoint(root / "step-2")
        assert report.ok and loads(root / "step-2", seed=2)
        step_2 = ["step-2", *filter(None, [report.version])]
        if os.path.lexists(root / "step-1"):
            # killed before the prune's one atomic removal: the checkpoint is whole, and
            # the next prune removes it
            assert gone_at is None and loads(root / "step-1", seed=1), (k, ops[k])
            remove_checkpoint(root / "step-1")
        elif gone_at is None:
            gone_at = k
        assert entries(root) == sorted(step_2), (k, ops[k], entries(root))
    assert gone_at is not None and gone_at < len(ops) - 2  # kills after the removal were met


def test_a_directory_checkpoint_on_a_filesystem_that_cannot_swap_is_saved_in_place(
    tmp_path, monkeypatch
):
    """A checkpoint directory copied to storage without RENAME_EXCHANGE (here: forced) is
    overwritten in place, metadata last; the files of the save it replaced go after."""
    path = tmp_path / "ckpt"
    save(path, seed=0)
    before = set(verify_checkpoint(path).files)
    monkeypatch.setenv("FSDP_EXT_CHECKPOINT_SWAP", "0")
    save(path, seed=1)
    report = verify_checkpoint(path)
    assert report.ok and loads(path, seed=1) and not path.is_symlink()
    assert not before & set(report.files)
    assert entries(path) == sorted([".metadata", ".manifest.json", *report.files])
    assert entries(tmp_path) == ["ckpt"]
