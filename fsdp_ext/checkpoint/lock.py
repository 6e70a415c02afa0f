"""One save at a time per checkpoint path: a lock that says who holds it.

The lock is a symbolic link ``.NAME.lock`` beside the checkpoint whose target text records
the holder (save id, host, boot id, pid and its start time, thread). Creating a link is
atomic and exclusive on local filesystems and over sshfs (SFTP ``symlink``), and the record
is born with the link, so no reader ever sees a half-written lock.

A lock is broken only when its holder is provably gone:

- same machine (host name and kernel boot id), and its process has exited (or the pid now
  belongs to a process that started later);
- same process, and the thread that took it is this thread, has exited, or is no longer
  inside a DCP save (a save that failed by exception cannot release it: DCP calls no writer
  method after a failed write).

Anything else (a live process, another machine) is a save that may be running: the caller
gets :class:`CheckpointBusyError` naming the holder and how to remove a lock left by a dead
job on another machine.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from fsdp_ext._torch import thread_in_dcp_save
from fsdp_ext.checkpoint.fs import CheckpointFS
from fsdp_ext.checkpoint.manifest import CheckpointBusyError

_KIND = "fsdp_ext.checkpoint.lock/1"


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _process_start(pid: int) -> str:
    """The start time of ``pid`` in clock ticks since boot, or "" if it is not running."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    # the command name (field 2) may hold spaces; fields after it are plain
    return stat.rpartition(")")[2].split()[19]


def _pid_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass(frozen=True)
class LockOwner:
    save_id: str
    host: str
    boot_id: str
    pid: int
    pid_start: str
    thread: int
    since: float

    @classmethod
    def here(cls, save_id: str) -> LockOwner:
        pid = os.getpid()
        return cls(
            save_id=save_id,
            host=socket.gethostname(),
            boot_id=_boot_id(),
            pid=pid,
            pid_start=_process_start(pid),
            thread=threading.get_ident(),
            since=round(time.time(), 3),
        )

    def encode(self) -> str:
        return json.dumps({"kind": _KIND, **asdict(self)}, sort_keys=True)

    @classmethod
    def decode(cls, text: str) -> LockOwner | None:
        """The owner recorded in a lock's link text; None if it is not one of our locks."""
        try:
            raw = json.loads(text)
            if raw.pop("kind") != _KIND:
                return None
            return cls(**raw)
        except (ValueError, KeyError, TypeError, AttributeError):
            return None

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.since))
        return f"save {self.save_id} by pid {self.pid} on host {self.host}, since {when}"

    def stale_reason(self) -> str | None:
        """Why the holder is provably gone, or None if it may still be saving."""
        if self.host != socket.gethostname() or self.boot_id != _boot_id() or not self.boot_id:
            return None
        if self.pid != os.getpid():
            if not _pid_running(self.pid):
                return f"its process {self.pid} has exited"
            if self.pid_start and _process_start(self.pid) not in ("", self.pid_start):
                return f"its process {self.pid} has exited (the pid was reused)"
            return None
        if self.thread == threading.get_ident():
            return "this thread took it for a save that has ended"
        if not any(t.ident == self.thread for t in threading.enumerate()):
            return f"its thread {self.thread} has exited"
        if not thread_in_dcp_save(self.thread):
            return f"its thread {self.thread} is no longer saving"
        return None


def lock_path(target: Path) -> Path:
    return target.parent / f".{target.name}.lock"


def acquire(fs: CheckpointFS, target: Path, owner: LockOwner) -> None:
    """Take the lock of ``target`` for ``owner``; break it only if its holder is gone."""
    path = lock_path(target)
    mine = owner.encode()
    for _ in range(3):
        try:
            fs.symlink(mine, path)
            return
        except FileExistsError:
            pass
        try:
            text = fs.readlink(path)
        except FileNotFoundError:
            continue  # released meanwhile
        held = LockOwner.decode(text)
        if held is None:
            raise CheckpointBusyError(
                f"{path}: exists but is not a lock made by SpreadFileSystemWriter; "
                f"remove it if nothing else uses it, then save to {target} again"
            )
        reason = held.stale_reason()
        if reason is None:
            raise CheckpointBusyError(
                f"{target}: another save holds its lock {path} ({held.describe()}); two "
                "jobs must not save to one path. If that job is dead (on another machine, "
                f"this writer cannot tell), remove {path} and save again"
            )
        # Move the stale lock aside under a name only this save uses, then check that
        # what moved is the lock that was judged (another saver may have broken and
        # retaken it in between); if not, put it back.
        aside = path.with_name(f"{path.name}.stale-{owner.save_id}")
        try:
            fs.replace(path, aside)
        except FileNotFoundError:
            continue
        moved = fs.readlink(aside)
        if moved != text:
            with contextlib.suppress(FileExistsError):
                fs.symlink(moved, path)
            fs.unlink(aside)
            raise CheckpointBusyError(
                f"{target}: another save took its lock {path} while this one checked it"
            )
        fs.unlink(aside)
    raise CheckpointBusyError(f"{target}: could not take its lock {path} in 3 attempts")


def release(fs: CheckpointFS, target: Path, owner: LockOwner) -> None:
    """Remove the lock if it is still ``owner``'s."""
    path = lock_path(target)
    try:
        if fs.readlink(path) == owner.encode():
            fs.unlink(path)
    except FileNotFoundError:
        pass
