"""The overwrite protocol: a SIGKILL at any step leaves the old or the new checkpoint, whole.

Each save runs in a forked child whose ``LocalStorage`` SIGKILLs the child just before its
k-th filesystem operation, for every k of an overwrite. After each kill the path must load
(with our reader and with the stock one) exactly the old values or exactly the new ones,
``verify_checkpoint`` must say which save it is, and the next save must succeed and leave
nothing but the path and its one version. Other tests: what is at the path is never deleted
unless this writer made it; two jobs saving to one path.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from fsdp_ext.checkpoint import (
    CheckpointBusyError,
    CheckpointPathError,
    LocalStorage,
    SafeLoadPlanner,
    SpreadFileSystemWriter,
    SpreadSavePlanner,
    VerifiedFileSystemReader,
    remove_checkpoint,
    verify_checkpoint,
)

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

SWAP_ENV = "FSDP_EXT_CHECKPOINT_SWAP"


@pytest.fixture(params=["swap", "link"])
def layout(request, monkeypatch) -> str:
    """Both publishing layouts: a directory swapped in (what ext4/tmpfs allow) and a link
    renamed onto the path (what sshfs allows), forced by the environment variable, which
    forked children inherit."""
    if request.param == "link":
        monkeypatch.setenv(SWAP_ENV, "0")
    else:
        monkeypatch.delenv(SWAP_ENV, raising=False)
    return request.param


def is_layout(path: Path, layout: str) -> bool:
    if layout == "link":
        return path.is_symlink()
    return path.is_dir() and not path.is_symlink()


_fork = mp.get_context("fork")


def state(seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {
        "layers.0.w": torch.randn(32, 16, generator=gen),
        "layers.1.w": torch.randn(32, 16, generator=gen),
        "embed": torch.randn(64, 16, generator=gen),
        "step": seed,
    }


def save(path: Path, seed: int, fs: LocalStorage | None = None, **kwargs) -> None:
    dcp.save(
        state(seed),
        storage_writer=SpreadFileSystemWriter(path, min_file_bytes=0, fs=fs, **kwargs),
        planner=SpreadSavePlanner(),
    )


def loads(path: Path, seed: int) -> bool:
    """Both readers load exactly the values of ``seed``."""
    want = state(seed)
    for reader, planner in (
        (VerifiedFileSystemReader(path), SafeLoadPlanner()),
        (dcp.FileSystemReader(path), None),
    ):
        got = {k: torch.zeros_like(v) if torch.is_tensor(v) else -1 for k, v in want.items()}
        dcp.load(got, storage_reader=reader, planner=planner)
        if not all(
            torch.equal(v, got[k]) if torch.is_tensor(v) else v == got[k] for k, v in want.items()
        ):
            return False
    return True


class Recording(LocalStorage):
    """Records every operation (name, path) in this process."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple[str, str]] = []

    def before(self, op, path):
        self.ops.append((op, str(path)))


class KillAt(LocalStorage):
    """SIGKILLs its own process just before operation number ``at`` (0-based)."""

    def __init__(self, at: int):
        super().__init__()
        self.at = at
        self.count = 0

    def before(self, op, path):
        if self.count == self.at:
            os.kill(os.getpid(), signal.SIGKILL)
        self.count += 1


def run_child(fn, *args) -> int:
    proc = _fork.Process(target=fn, args=args)
    proc.start()
    proc.join(60)
    assert not proc.is_alive()
    return proc.exitcode


def entries(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def test_sigkill_at_every_step_of_an_overwrite_leaves_old_or_new(tmp_path, layout):
    rehearsal = tmp_path / "rehearsal"
    rehearsal.mkdir()
    save(rehearsal / "ckpt", seed=0)
    recording = Recording()
    save(rehearsal / "ckpt", seed=1, fs=recording)
    ops = [(op, path.replace(str(rehearsal), "")) for op, path in recording.ops]
    if layout == "swap":
        publish = ops.index(("exchange", "/ckpt"))
        assert ("symlink", "/ckpt") not in ops and ("rename", "/ckpt") not in ops
    else:
        publish = ops.index(("rename", "/ckpt"))
        assert ops[publish - 2][0] == "symlink" and ("exchange", "/ckpt") not in ops
    assert len(ops) > publish + 2  # cleanup follows
    seen = {"old": 0, "new": 0, "never published": 0, "previous": 0}

    for k in range(len(ops) + 1):
        root = tmp_path / f"kill{k}"
        root.mkdir()
        path = root / "ckpt"
        save(path, seed=0)
        assert is_layout(path, layout)
        old = verify_checkpoint(path)
        code = run_child(save, path, 1, KillAt(k))
        assert code == (-signal.SIGKILL if k < len(ops) else 0), (k, ops[k : k + 1], code)
        report = verify_checkpoint(path)
        assert report.ok, (k, ops[k], report.problems)
        which = "old" if k <= publish else "new"
        assert (report.save_id == old.save_id) == (which == "old"), (k, ops[k : k + 1])
        assert loads(path, seed=0 if which == "old" else 1), (k, ops[k : k + 1])
        seen[which] += 1
        notes = " ".join(report.notes)
        if "that was never published" in notes:
            seen["never published"] += 1
            assert which == "old" and (report.version or f"is save {old.save_id}") in notes
        if "the previous checkpoint" in notes:
            seen["previous"] += 1
            assert which == "new" and f"(save {old.save_id})" in notes
        # the next save succeeds (the killed save's lock is stale: its process is gone)
        # and removes what the killed one left, and only that
        save(path, seed=2)
        after = verify_checkpoint(path)
        assert after.ok and after.notes == [] and loads(path, seed=2), (k, after.notes)
        assert is_layout(path, layout)
        assert entries(root) == sorted(["ckpt", *filter(None, [after.version])]), k
        remove_checkpoint(path)
        assert entries(root) == [], (k, entries(root))
    # every kind of interruption was met: before the publish (an unfinished or a complete
    # unpublished new version), after it (the old version not yet removed)
    assert seen["old"] == publish + 1 and seen["new"] == len(ops) - publish
    assert seen["never published"] >= 1 and seen["previous"] >= 1, seen


def _fail_in_write(path: Path) -> None:
    class Failing(LocalStorage):
        def before(self, op, p):
            if op == "write" and str(p).endswith(".distcp"):
                raise OSError(5, "injected I/O error", str(p))

    save(path, seed=1, fs=Failing())


def test_a_failed_save_in_this_thread_does_not_block_the_next(tmp_path, layout):
    """A save that raises leaves its lock (DCP calls no writer method after a failed write);
    the next save from the same thread knows that save has ended, and cleans up after it."""
    path = tmp_path / "ckpt"
    save(path, seed=0)
    with pytest.raises(CheckpointException, match="injected I/O error"):
        _fail_in_write(path)
    assert (tmp_path / ".ckpt.lock").is_symlink()
    assert verify_checkpoint(path).ok and loads(path, seed=0)
    save(path, seed=2)
    report = verify_checkpoint(path)
    assert report.ok and loads(path, seed=2)
    assert entries(tmp_path) == sorted(["ckpt", *filter(None, [report.version])])


# -- what is at the path -------------------------------------------------------------------


def refused(path: Path) -> CheckpointPathError:
    with pytest.raises(CheckpointException) as err:
        save(path, seed=1)
    (cause, _), *_ = err.value.failures.values()
    assert isinstance(cause, CheckpointPathError), cause
    assert "\n" not in str(cause) and str(cause).startswith(f"{path}: ")
    return cause


def test_a_directory_of_unknown_files_is_kept_and_written_beside(tmp_path, layout):
    path = tmp_path / "ckpt"
    (path / "src").mkdir(parents=True)
    (path / "notes.txt").write_text("mine")
    (path / "src" / "train.py").write_text("print(1)")
    save(path, seed=0)
    save(path, seed=1)
    assert loads(path, seed=1) and verify_checkpoint(path).ok
    assert entries(tmp_path) == ["ckpt"] and path.is_dir() and not path.is_symlink()
    assert (path / "notes.txt").read_text() == "mine"
    assert (path / "src" / "train.py").read_text() == "print(1)"


def test_a_stock_checkpoint_at_the_path_is_overwritten_in_place_and_kept(tmp_path, layout):
    path = tmp_path / "ckpt"
    dcp.save(state(0), storage_writer=dcp.FileSystemWriter(path))
    files = set(entries(path)) - {".metadata"}
    save(path, seed=1)
    assert loads(path, seed=1) and files <= set(entries(path)) and entries(tmp_path) == ["ckpt"]


def test_a_regular_file_is_refused_before_anything_is_written(tmp_path):
    path = tmp_path / "ckpt"
    path.write_text("not a checkpoint")
    error = refused(path)
    assert "regular file" in str(error)
    assert entries(tmp_path) == ["ckpt"] and path.read_text() == "not a checkpoint"


def test_a_foreign_link_is_refused_and_kept(tmp_path):
    (tmp_path / "elsewhere").mkdir()
    path = tmp_path / "ckpt"
    path.symlink_to("elsewhere")
    error = refused(path)
    assert "symbolic link to 'elsewhere'" in str(error)
    assert os.readlink(path) == "elsewhere" and entries(tmp_path) == ["ckpt", "elsewhere"]


def test_an_empty_directory_is_replaced(tmp_path, layout):
    path = tmp_path / "ckpt"
    path.mkdir()
    save(path, seed=0)
    assert is_layout(path, layout) and loads(path, seed=0)


def test_unknown_entries_beside_the_path_survive_saves(tmp_path, layout):
    """Look-alike names without this writer's records are not provably its own."""
    path = tmp_path / "ckpt"
    lookalike = tmp_path / ".ckpt.v-not-mine"
    lookalike.mkdir()
    (lookalike / "data.bin").write_bytes(b"x" * 10)
    (tmp_path / "notes.txt").write_text("keep")
    save(path, seed=0)
    save(path, seed=1)
    remove_checkpoint(path)
    assert entries(tmp_path) == [".ckpt.v-not-mine", "notes.txt"]
    assert (lookalike / "data.bin").read_bytes() == b"x" * 10


def test_remove_checkpoint_removes_link_and_versions(tmp_path, layout):
    path = tmp_path / "ckpt"
    save(path, seed=0)
    remove_checkpoint(path)
    assert entries(tmp_path) == []


# -- two jobs, one path --------------------------------------------------------------------


class PauseInWrite(LocalStorage):
    """Waits before writing its first data file until ``go`` exists."""

    def __init__(self, go: Path):
        super().__init__()
        self.go = go

    def before(self, op, path):
        if op == "write" and str(path).endswith(".distcp"):
            deadline = time.monotonic() + 60
            while not self.go.exists() and time.monotonic() < deadline:
                time.sleep(0.02)


def test_a_second_job_gets_a_clear_error_and_deletes_nothing(tmp_path, layout):
    path = tmp_path / "ckpt"
    save(path, seed=0)
    go = tmp_path / "go"
    job_a = _fork.Process(target=save, args=(path, 1, PauseInWrite(go)))
    job_a.start()
    try:
        deadline = time.monotonic() + 30
        while not list(tmp_path.glob(".ckpt.v-*/.plan.json")) and time.monotonic() < deadline:
            time.sleep(0.02)
        staging = [p.parent for p in tmp_path.glob(".ckpt.v-*/.plan.json")]
        assert len(staging) == 1 and staging[0].name != verify_checkpoint(path).version
        before = entries(staging[0])
        with pytest.raises(CheckpointException) as err:
            save(path, seed=2)  # job B, same path, while A is writing
        (cause, _), *_ = err.value.failures.values()
        assert isinstance(cause, CheckpointBusyError), cause
        message = str(cause)
        assert "two jobs must not save to one path" in message and f"pid {job_a.pid}" in message
        assert entries(staging[0]) == before  # A's staging untouched
        # and B left nothing: A's version (and, linked, the current one) only
        assert len(list(tmp_path.glob(".ckpt.v-*"))) == (2 if layout == "link" else 1)
    finally:
        go.touch()
        job_a.join(60)
    assert job_a.exitcode == 0
    report = verify_checkpoint(path)
    assert report.ok and loads(path, seed=1) and is_layout(path, layout)
    assert report.version == (staging[0].name if layout == "link" else None)
