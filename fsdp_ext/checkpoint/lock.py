"""One save at a time per checkpoint path: a lock with a lease that says who holds it.

The lock is a symbolic link ``.NAME.lock`` beside the checkpoint whose target text records
the holder (save id, run id, host, boot id, pid and its start time, thread, lease). Creating
a link is atomic and exclusive on local filesystems and over sshfs (SFTP ``symlink``), and
the record is born with the link, so no reader ever sees a half-written lock. While it is
held, a heartbeat thread of the holder's process touches the link's mtime every quarter
lease: the mtime is the holder's last sign of life.

A lock is broken only when its holder is provably gone:

- same machine (host name and kernel boot id), and its process has exited, or the pid now
  belongs to a process that started later (the start time in ``/proc/PID/stat`` differs:
  pids are reused);
- same process, and the thread that took it is this thread, has exited, or is no longer
  inside a DCP save (a save that failed by exception cannot release it: DCP calls no writer
  method after a failed write);
- another machine, and the holder belongs to the same run (``TORCHELASTIC_RUN_ID``): an
  earlier attempt of this job, which its launcher has given up on; taken over at once;
- another machine, and its heartbeat is older than its lease: the taker waits for that,
  saying so every few seconds, and refuses as soon as it sees the heartbeat move. The hosts'
  clocks must agree to well within the lease (NTP does).

Anything else (a live process here, a heartbeat that moves) is a save that is running: the
caller gets :class:`CheckpointBusyError` naming the holder.

Readers take a shared lease the same way, ``.NAME.read-<id>``, so that pruning skips a
checkpoint being loaded (:func:`read_lease`, :func:`refuse_if_read`).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import threading
import time
import uuid
import warnings
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from fsdp_ext._torch import thread_in_dcp_save
from fsdp_ext.checkpoint.fs import LocalStorage
from fsdp_ext.checkpoint.manifest import CheckpointBusyError, CheckpointPathError
from fsdp_ext.checkpoint.processes import boot_id, pid_running, process_start
from fsdp_ext.checkpoint.storage import DIRECTORY, LINK, CheckpointStorage

__all__ = [
    "DEFAULT_LEASE_S",
    "CheckpointPrunedError",
    "LockOwner",
    "acquire",
    "lease_seconds",
    "lock_path",
    "read_lease",
    "readers",
    "refuse_if_read",
    "release",
    "run_id",
    "unlock",
]

_KIND = "fsdp_ext.checkpoint.lock/1"
DEFAULT_LEASE_S = 60.0
LEASE_ENV = "FSDP_EXT_LEASE_S"  # the lease in seconds for locks and owners this process takes
RUN_ID_ENV = "FSDP_EXT_RUN_ID"  # set by a launcher that outlives torchrun's own run ids
_READ = ".read-"
_REMOVER = "remove-"  # save ids of remove_checkpoint's locks


class CheckpointPrunedError(CheckpointPathError):
    """The checkpoint was pruned (or is being pruned) while it was to be read; try another."""


def lease_seconds() -> float:
    """The lease this process gives its locks: ``$FSDP_EXT_LEASE_S``, else 60 s."""
    text = os.environ.get(LEASE_ENV)
    if text is None:
        return DEFAULT_LEASE_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"{LEASE_ENV} must be a number of seconds > 0, got {text!r}")
    return value


def run_id() -> str:
    """This job's run id ("" when it has none): ``$FSDP_EXT_RUN_ID`` (set by a launcher such
    as examples/train.py), else torchrun's ``$TORCHELASTIC_RUN_ID``."""
    return os.environ.get(RUN_ID_ENV) or os.environ.get("TORCHELASTIC_RUN_ID") or ""


@dataclass(frozen=True)
class LockOwner:
    save_id: str
    host: str
    boot_id: str
    pid: int
    pid_start: str
    thread: int
    since: float
    run_id: str = ""
    lease_s: float = DEFAULT_LEASE_S

    @classmethod
    def here(cls, save_id: str, *, lease_s: float | None = None) -> LockOwner:
        pid = os.getpid()
        return cls(
            save_id=save_id,
            host=socket.gethostname(),
            boot_id=boot_id(),
            pid=pid,
            pid_start=process_start(pid),
            thread=threading.get_ident(),
            since=round(time.time(), 3),
            run_id=run_id(),
            lease_s=lease_seconds() if lease_s is None else float(lease_s),
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
        run = f", run {self.run_id}" if self.run_id else ""
        kind, _, ident = self.save_id.partition("-")
        what = f"job {ident}" if kind == "owner" else f"save {self.save_id}"
        return f"{what} by pid {self.pid} on host {self.host}{run}, since {when}"

    def on_this_machine(self) -> bool:
        return bool(self.boot_id) and (self.host, self.boot_id) == (
            socket.gethostname(),
            boot_id(),
        )

    def same_run(self) -> bool:
        mine = run_id()
        return bool(mine) and self.run_id == mine

    def stale_reason(self, heartbeat_age: float | None = None) -> str | None:
        """Why the holder is provably gone, or None if it may still be working.

        ``heartbeat_age``: seconds since the lock's last heartbeat (None: unknown), which
        decides for a holder on another machine.
        """
        if not self.on_this_machine():
            if self.same_run():
                return (
                    f"it belongs to an earlier attempt of this run ({self.run_id}) on host "
                    f"{self.host}"
                )
            if heartbeat_age is not None and heartbeat_age > self.lease_s:
                return (
                    f"its lease expired: no heartbeat from host {self.host} for "
                    f"{heartbeat_age:.0f} s (lease {self.lease_s:g} s)"
                )
            return None
        if self.pid != os.getpid():
            if not pid_running(self.pid):
                return f"its process {self.pid} has exited"
            if self.pid_start and process_start(self.pid) not in ("", self.pid_start):
                return f"its process {self.pid} has exited (the pid was reused)"
            return None
        if self.thread == threading.get_ident():
            return "this thread took it for a save that has ended"
        if not any(t.ident == self.thread for t in threading.enumerate()):
            return f"its thread {self.thread} has exited"
        if not thread_in_dcp_save(self.thread):
            return f"its thread {self.thread} is no longer saving"
        return None


# ------------------------------------------------------------------------- heartbeat


@dataclass
class _Heartbeat:
    """One daemon thread per process renews every lease it holds (touches the links)."""

    # path -> (its storage, the link's text, lease)
    held: dict[str, tuple[CheckpointStorage, str, float]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    wake: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None

    def add(self, fs: CheckpointStorage, path: Path, text: str, lease_s: float) -> None:
        with self.lock:
            self.held[str(path)] = (fs, text, lease_s)
            if self.thread is None or not self.thread.is_alive():
                self.thread = threading.Thread(
                    target=self._run, name="fsdp_ext-lease-heartbeat", daemon=True
                )
                self.thread.start()
        self.wake.set()

    def remove(self, path: Path) -> None:
        with self.lock:
            self.held.pop(str(path), None)

    def _run(self) -> None:
        while True:
            with self.lock:
                held = dict(self.held)
            for path, (fs, text, _lease) in held.items():
                fs.renew_lease(path, text)
            period = min((lease for *_, lease in held.values()), default=DEFAULT_LEASE_S) / 4
            self.wake.wait(max(0.05, period))
            self.wake.clear()


_HEARTBEAT = _Heartbeat()


def _after_fork() -> None:  # a forked child holds none of its parent's leases
    global _HEARTBEAT
    _HEARTBEAT = _Heartbeat()


os.register_at_fork(after_in_child=_after_fork)


def heartbeat_age(fs: CheckpointStorage, path: str | os.PathLike) -> float | None:
    """Seconds since the lock's last heartbeat (its link's mtime); None if it is gone."""
    try:
        return time.time() - fs.mtime(path)
    except FileNotFoundError:
        return None


def hold(fs: CheckpointStorage, path: Path, owner: LockOwner) -> None:
    """Keep renewing ``path``'s lease for ``owner`` until :func:`let_go`."""
    _HEARTBEAT.add(fs, path, owner.encode(), owner.lease_s)


def let_go(path: Path) -> None:
    _HEARTBEAT.remove(path)


def holding(path: Path) -> bool:
    """Whether this process holds (and renews) the lock at ``path``."""
    return str(path) in _HEARTBEAT.held


def _say(message: str) -> None:
    print(f"fsdp_ext.checkpoint: {message}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------- the lock


def lock_path(target: Path) -> Path:
    return target.parent / f".{target.name}.lock"


def take(
    fs: CheckpointStorage,
    path: Path,
    owner: LockOwner,
    *,
    what: str,
) -> LockOwner | None:
    """Create the lock link ``path`` for ``owner``, breaking it if its holder is gone.

    Returns None when taken, or the live holder: on this machine at once, on another when
    its heartbeat moves while this waits for its lease. ``what`` names the guarded thing in
    messages. A holder on another machine whose heartbeat
    stands still is waited for (at most its lease, plus a second).
    """
    mine = owner.encode()
    seen: tuple[str, float] | None = None  # (record, mtime) when first seen
    deadline = None
    said = 0.0
    while True:
        try:
            fs.symlink(mine, path)
            hold(fs, path, owner)
            return None
        except FileExistsError:
            pass
        try:
            text = fs.readlink(path)
            mtime = fs.mtime(path)
        except FileNotFoundError:
            continue  # released meanwhile
        held = LockOwner.decode(text)
        if held is None:
            raise CheckpointBusyError(
                f"{path}: exists but is not a lock made by fsdp_ext; remove it if nothing "
                f"else uses it, then try {what} again"
            )
        reason = held.stale_reason(time.time() - mtime)
        if reason is None:
            if held.on_this_machine():
                return held
            if seen is not None and seen[0] == text and mtime != seen[1]:
                return held  # its heartbeat moved: alive
            if seen is None or seen[0] != text:
                seen = (text, mtime)
                deadline = time.monotonic() + held.lease_s + 1.0
            left = mtime + held.lease_s - time.time()
            if time.monotonic() > deadline:
                return held
            if time.monotonic() - said >= 5.0:
                said = time.monotonic()
                _say(
                    f"{what}: held by {held.describe()} on another host; waiting up to "
                    f"{max(0.0, left):.0f} s for its lease ({held.lease_s:g} s) to expire "
                    "unless its heartbeat moves"
                )
            time.sleep(min(0.25, held.lease_s / 8))
            continue
        warnings.warn(
            f"{what}: breaking the lock {path} of {held.describe()}: {reason}", stacklevel=3
        )
        # Move the stale lock aside under a name only this taker uses, then check that
        # what moved is the lock that was judged (another taker may have broken and
        # retaken it in between); if not, put it back.
        aside = path.with_name(f"{path.name}.stale-{owner.save_id}")
        try:
            fs.rename(path, aside)
        except FileNotFoundError:
            continue
        moved = fs.readlink(aside)
        if moved != text:
            with contextlib.suppress(FileExistsError):
                fs.symlink(moved, path)
            fs.unlink(aside)
            raise CheckpointBusyError(
                f"{what}: another taker took {path} while this one checked it"
            )
        fs.unlink(aside)


def acquire(fs: CheckpointStorage, target: Path, owner: LockOwner) -> None:
    """Take the lock of ``target`` for ``owner``; break it only if its holder is gone."""
    path = lock_path(target)
    held = take(fs, path, owner, what=f"save to {target}")
    if held is not None:
        raise CheckpointBusyError(
            f"{target}: another save holds its lock {path} ({held.describe()}); two "
            "jobs must not save to one path. If that job is dead and this one cannot tell "
            f"(a machine whose clock is off), run `python -m fsdp_ext.checkpoint unlock "
            f"{target}` and save again"
        )


def release(fs: CheckpointStorage, target: Path, owner: LockOwner) -> None:
    """Remove the lock if it is still ``owner``'s."""
    release_link(fs, lock_path(target), owner.encode())


def release_link(fs: CheckpointStorage, path: Path, text: str) -> None:
    let_go(path)
    try:
        if fs.readlink(path) == text:
            fs.unlink(path)
    except FileNotFoundError:
        pass


def unlock(
    target: str | os.PathLike, fs: CheckpointStorage | None = None
) -> tuple[Path | None, LockOwner | None]:
    """Remove the lock of ``target`` whoever holds it (the manual last resort).

    ``target``: a checkpoint path, its ``.NAME.lock``, or an output directory's ``.owner``
    (or the directory itself). Returns the link removed (None: none there) and the holder it
    recorded (None: not one of ours, removed all the same).
    """
    fs = fs if fs is not None else LocalStorage()
    target = Path(target)
    if target.name.endswith(".lock") or target.name == ".owner":
        path = target
    elif fs.kind(target / ".owner") == LINK:
        path = target / ".owner"
    else:
        path = lock_path(target)
    try:
        text = fs.readlink(path)
    except (FileNotFoundError, OSError):
        return None, None
    let_go(path)
    fs.unlink(path)
    return path, LockOwner.decode(text)


# ------------------------------------------------------------------------- read leases


def _is_read_lease(name: str, target: Path) -> bool:
    return name.startswith(f".{target.name}{_READ}")


def readers(fs: CheckpointStorage, target: Path) -> list[LockOwner]:
    """The live readers of ``target``; read leases of readers that are gone are removed."""
    live = []
    for name in fs.listdir(target.parent):
        if not _is_read_lease(name, target):
            continue
        path = target.parent / name
        try:
            text = fs.readlink(path)
        except (FileNotFoundError, OSError):
            continue
        holder = LockOwner.decode(text)
        age = heartbeat_age(fs, path)
        if holder is None or age is None:
            continue
        if holder.stale_reason(age) is None or holder.pid == os.getpid():
            live.append(holder)
        else:
            with contextlib.suppress(FileNotFoundError):
                fs.unlink(path)
    return live


def refuse_if_read(fs: CheckpointStorage, target: Path) -> None:
    """Raise :class:`CheckpointBusyError` if a live reader holds ``target``; call it under
    ``target``'s lock, before removing anything (a reader checks that lock after taking its
    lease, so one of the two always sees the other)."""
    found = readers(fs, target)
    if found:
        raise CheckpointBusyError(
            f"{target}: being read by {found[0].describe()}; not removing it now (the next "
            "prune will)"
        )


@contextlib.contextmanager
def read_lease(target: str | os.PathLike, fs: CheckpointStorage | None = None) -> Iterator[None]:
    """Hold a shared read lease on ``target`` while the block reads it, so no prune removes
    it meanwhile. Raises :class:`CheckpointPrunedError` when it is gone or being removed."""
    fs = fs if fs is not None else LocalStorage()
    target = Path(target)
    owner = LockOwner.here(f"read-{uuid.uuid4().hex[:12]}")
    path = target.parent / f".{target.name}{_READ}{owner.save_id[5:]}"
    fs.symlink(owner.encode(), path)
    hold(fs, path, owner)
    try:
        lock = lock_path(target)
        try:
            holder = LockOwner.decode(fs.readlink(lock))
        except FileNotFoundError:
            holder = None
        if (
            holder is not None
            and holder.save_id.startswith(_REMOVER)
            and holder.stale_reason(heartbeat_age(fs, lock)) is None
        ):
            raise CheckpointPrunedError(f"{target}: is being pruned ({holder.describe()})")
        if fs.kind(target) not in (LINK, DIRECTORY):
            raise CheckpointPrunedError(f"{target}: was pruned before it could be read")
        yield
    finally:
        release_link(fs, path, owner.encode())
