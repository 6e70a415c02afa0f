"""One job owns an output directory, and a job that lost it writes nothing more there.

**Generations.** The owner records live in ``ROOT/.owner/``, one per owner generation:
``gen-00000001``, ``gen-00000002``... Each is a lease of ``lock.py`` (an immutable record of
host, boot id, pid, run id and lease, plus a heartbeat that only its holder rewrites). The
owner is the highest generation. Taking the directory over is *creating* the next
generation's record, which only one claimant can do (create-if-absent: an exclusive
``symlink`` here, ``If-None-Match: *`` on an object store). A claimant judges the current
owner as ``lock.watch`` does: at once on the same machine (pid and start time) or for the
same run (a restart), else by its own monotonic clock (gone after a whole lease without a
heartbeat change). A finished job writes ``released`` as its last heartbeat; the next
claimant takes over at once.

**Fencing.** Each generation has a private work directory, ``.owner/gen-N.work``. A save
stages its new version there and publishes it by renaming it out; a prune or overwrite
discards by renaming into it (``versions.py``). A takeover creates its record, then renames
every older generation's work directory away, *before* it reads or writes any checkpoint.
From then on, each publish or removal of the old job fails in the storage itself, since its
source or destination no longer exists, however long the old job was paused and wherever it
was paused: a check of ownership followed by an unconditional write would not be fencing,
since a pause between the two defeats it. The old job's next save also sees the newer
generation first and stops with :class:`DirectoryFencedError` (``examples/train.py`` exits
3), naming who took the directory.

A worker of the job whose launcher holds the record (same run, same machine) joins that
generation; the launcher renews and releases it.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import os
import signal
import uuid
import warnings
from dataclasses import dataclass
from pathlib import Path

from fsdp_ext.checkpoint.fence import (
    OWNER_DIR,
    RECORD,
    Fence,
    generations,
    holder,
    record_name,
)
from fsdp_ext.checkpoint.location import posix_storage
from fsdp_ext.checkpoint.lock import (
    RELEASED,
    LockOwner,
    beat_path,
    check_lease,
    hold,
    holding,
    let_go,
    observe,
    replace_link,
    watch,
)
from fsdp_ext.checkpoint.manifest import CheckpointBusyError
from fsdp_ext.checkpoint.storage import DIRECTORY, CheckpointStorage
from fsdp_ext.warm import CLIENT_ENV as WARM_CLIENT_ENV

__all__ = [
    "LAUNCHER_PID_ENV",
    "DirectoryOwnedError",
    "Ownership",
    "claim",
    "exit_with_launcher",
    "owner_gone",
]

LAUNCHER_PID_ENV = "FSDP_EXT_LAUNCHER_PID"  # set by a launcher that runs torchrun in-process
_PR_SET_PDEATHSIG = 1
_TRASH = "trash-"


class DirectoryOwnedError(CheckpointBusyError):
    """Another live job owns the output directory; the message names it and what to do."""


@dataclass
class Ownership:
    """This process's claim on ``root``: its own generation's record (``joined`` False) or
    the record of the launcher of its own run (``joined`` True, left to that launcher)."""

    root: Path
    owner: LockOwner
    joined: bool
    fs: CheckpointStorage

    @property
    def record(self) -> Path:
        return self.root / OWNER_DIR / record_name(self.owner.generation)

    @property
    def fence(self) -> Fence:
        return Fence(self.root, self.owner.generation, self.fs)

    def release(self) -> None:
        """Give the directory up (a finished job): a later job takes it at once."""
        if self.joined:
            return
        let_go(self.record)
        if self.fence.lost() is None:
            with contextlib.suppress(OSError):
                replace_link(self.fs, beat_path(self.record, self.owner), RELEASED)

    def stop_renewing(self) -> None:
        """Stop the heartbeat but keep the record: how a job that dies looks to others."""
        let_go(self.record)


def claim(
    root: str | os.PathLike, *, lease_s: float | None = None, fs: CheckpointStorage | None = None
) -> Ownership:
    """Make this job the owner of ``root`` (created if missing), or raise
    :class:`DirectoryOwnedError` naming the live owner."""
    fs = posix_storage(fs)
    if lease_s is not None:
        lease_s = check_lease(lease_s)
    root = Path(root)
    owners = root / OWNER_DIR
    fs.makedirs(owners)
    me = LockOwner.here(f"owner-{uuid.uuid4().hex[:12]}", lease_s=lease_s)
    if any(holding(owners / record_name(g)) for g in generations(fs, root)):
        raise DirectoryOwnedError(
            f"{root}: this process owns it already (another Checkpointer on it is open); "
            "close() that one first, or use it"
        )
    while True:
        found = generations(fs, root)
        top = found[-1] if found else 0
        if top:
            record = owners / record_name(top)
            seen = watch(fs, record, what=f"output directory {root}")
            if seen is None:
                continue
            _text, held, reason = seen
            if reason is None:
                if held.same_run() and held.on_this_machine():
                    return Ownership(root, held, True, fs)  # our own launcher holds it
                raise _owned(fs, root, record, held)
            if reason != "it gave it up":
                warnings.warn(
                    f"output directory {root}: taking it over from {held.describe()}: {reason}",
                    stacklevel=2,
                )
        mine = dataclasses.replace(me, generation=top + 1)
        try:
            fs.symlink(mine.encode(), owners / record_name(mine.generation))
        except FileExistsError:
            continue  # another claimant took this generation first: judge it
        ownership = Ownership(root, mine, False, fs)
        retire(fs, root, below=mine.generation)  # the fence: before any checkpoint is read
        fs.make_dir(ownership.fence.work_dir)
        hold(fs, ownership.record, mine, still_mine=ownership.fence.lost)
        return ownership


def _owned(fs: CheckpointStorage, root: Path, record: Path, held: LockOwner) -> DirectoryOwnedError:
    _changed, still = observe(fs, record, fs.readlink(record), held)
    beat = "" if held.on_this_machine() else f", last seen change {still:.0f} s ago"
    return DirectoryOwnedError(
        f"{root}: owned by a live job, {held.describe()} (lease {held.lease_s:g} s{beat}); "
        "two jobs must not write one output directory. Wait for that job to end or stop "
        "it, or choose another output directory; a restart of the same run "
        "(TORCHELASTIC_RUN_ID) is let in once that job is gone"
    )


def retire(fs: CheckpointStorage, root: Path, *, below: int) -> None:
    """Fence every generation below ``below``: rename its work directory away (one atomic
    step: from then on its saves and prunes fail), then remove it, its record and beats."""
    owners = root / OWNER_DIR
    for name in fs.listdir(owners):
        head = name.split(".", 1)[0]
        m = RECORD.fullmatch(head)
        path = owners / name
        if name.startswith(_TRASH):
            fs.remove_tree(path, missing_ok=True)  # a retire killed midway
        elif m is None or int(m.group(1)) >= below:
            continue
        elif fs.kind(path) == DIRECTORY:
            trash = owners / f"{_TRASH}{uuid.uuid4().hex}"
            with contextlib.suppress(FileNotFoundError):
                fs.rename(path, trash)
                fs.remove_tree(trash, missing_ok=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                fs.unlink(path)


def owner_gone(root: str | os.PathLike, fs: CheckpointStorage | None = None) -> str | None:
    """Why the job owning ``root`` is certainly gone (it released it, none ever owned it, or
    its process on this machine exited), looking once; None when it may be alive."""
    fs = posix_storage(fs)
    found = generations(fs, root)
    if not found:
        return f"no job owns {root}"
    record = Path(root) / OWNER_DIR / record_name(found[-1])
    owner = holder(fs, Path(root), found[-1])
    if owner is None:
        return None
    try:
        if fs.readlink(beat_path(record, owner)) == RELEASED:
            return f"its job released {root}"
    except OSError:
        pass
    if owner.on_this_machine() and owner.pid != os.getpid():
        return owner.stale_reason()
    return None


def exit_with_launcher() -> bool:
    """Under torchrun, make this worker die (SIGKILL) when its launcher dies, so an orphan
    cannot keep training and saving beside a restarted job. Returns whether it is set.

    ``prctl(PR_SET_PDEATHSIG)`` fires when the parent exits; a launcher that died before
    the call is caught by comparing the parent with the launcher's pid
    (``$FSDP_EXT_LAUNCHER_PID`` when the launcher set it, else the parent seen first).
    """
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return False
    if os.environ.get(WARM_CLIENT_ENV):
        # forked by a warm server (fsdp_ext.warm): its parent is the server, and the tie is
        # the client's, which dies with the launcher and takes this worker along
        return True
    expected = int(os.environ.get(LAUNCHER_PID_ENV) or os.getppid())
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_PDEATHSIG): {os.strerror(err)}")
    if os.getppid() != expected:  # the launcher died before the signal was armed
        os.kill(os.getpid(), signal.SIGKILL)
    return True
