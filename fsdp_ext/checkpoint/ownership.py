"""One job owns an output directory for its whole life; its workers die with its launcher.

The owner record is a lease lock (``lock.py``) named ``.owner`` in the directory: host, boot
id, pid and start time, run id, lease, renewed by a heartbeat thread. A second job is
refused while the owner is alive: on this machine its process is running (pid and start
time), on another its heartbeat moves (the claimant waits at most one lease to see which).
Once the owner is gone (its process exited, its lease expired, or it released the record
at its end), a restart takes the directory over. A restart of the same run (torchrun's own
restart, or a requeue under the same ``TORCHELASTIC_RUN_ID``) takes it over at once, and a
worker of the job whose launcher holds the record (same run, same machine) joins it.
"""

from __future__ import annotations

import ctypes
import os
import signal
import uuid
from dataclasses import dataclass
from pathlib import Path

from fsdp_ext.checkpoint.fs import LocalStorage
from fsdp_ext.checkpoint.lock import (
    LockOwner,
    heartbeat_age,
    holding,
    let_go,
    release_link,
    take,
)
from fsdp_ext.checkpoint.manifest import CheckpointBusyError
from fsdp_ext.checkpoint.storage import CheckpointStorage

__all__ = ["OWNER_NAME", "DirectoryOwnedError", "Ownership", "claim", "exit_with_launcher"]

OWNER_NAME = ".owner"
LAUNCHER_PID_ENV = "FSDP_EXT_LAUNCHER_PID"  # set by a launcher that runs torchrun in-process
_PR_SET_PDEATHSIG = 1


class DirectoryOwnedError(CheckpointBusyError):
    """Another live job owns the output directory; the message names it and what to do."""


@dataclass
class Ownership:
    """This process's claim on ``root``: its own record (``joined`` False) or the record of
    the launcher of its own run (``joined`` True, left to that launcher to release)."""

    root: Path
    owner: LockOwner
    joined: bool
    fs: CheckpointStorage

    def release(self) -> None:
        """Give the directory up (a finished job); a later job takes it at once."""
        if not self.joined:
            release_link(self.fs, self.root / OWNER_NAME, self.owner.encode())

    def stop_renewing(self) -> None:
        """Stop the heartbeat but keep the record: how a job that dies looks to others."""
        let_go(self.root / OWNER_NAME)


def claim(
    root: str | os.PathLike, *, lease_s: float | None = None, fs: CheckpointStorage | None = None
) -> Ownership:
    """Make this job the owner of ``root`` (created if missing), or raise
    :class:`DirectoryOwnedError` naming the live owner."""
    fs = fs if fs is not None else LocalStorage()
    root = Path(root)
    fs.makedirs(root)
    owner = LockOwner.here(f"owner-{uuid.uuid4().hex[:12]}", lease_s=lease_s)
    path = root / OWNER_NAME
    if holding(path):
        raise DirectoryOwnedError(
            f"{root}: this process owns it already (another Checkpointer on it is open); "
            "close() that one first, or use it"
        )
    held = take(fs, path, owner, what=f"output directory {root}")
    if held is None:
        return Ownership(root, owner, False, fs)
    if held.same_run() and held.on_this_machine():
        return Ownership(root, held, True, fs)  # our own launcher holds it
    age = heartbeat_age(fs, path)
    beat = "" if age is None else f", last heartbeat {age:.0f} s ago"
    raise DirectoryOwnedError(
        f"{root}: owned by a live job, {held.describe()} (lease {held.lease_s:g} s{beat}); "
        "two jobs must not write one output directory. Wait for that job to end or stop "
        "it, or choose another output directory; a restart of the same run "
        "(TORCHELASTIC_RUN_ID) is let in once that job is gone. If it is gone and this "
        f"cannot tell, run `python -m fsdp_ext.checkpoint unlock {path}`"
    )


def exit_with_launcher() -> bool:
    """Under torchrun, make this worker die (SIGKILL) when its launcher dies, so an orphan
    cannot keep training and saving beside a restarted job. Returns whether it is set.

    ``prctl(PR_SET_PDEATHSIG)`` fires when the parent exits; a launcher that died before
    the call is caught by comparing the parent with the launcher's pid
    (``$FSDP_EXT_LAUNCHER_PID`` when the launcher set it, else the parent seen first).
    """
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return False
    expected = int(os.environ.get(LAUNCHER_PID_ENV) or os.getppid())
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_PDEATHSIG): {os.strerror(err)}")
    if os.getppid() != expected:  # the launcher died before the signal was armed
        os.kill(os.getpid(), signal.SIGKILL)
    return True
