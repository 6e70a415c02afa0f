"""Leases that need no agreement of clocks and no mtime: who holds a thing, and whether they live.

A lease is two symbolic links (a link's text is born with it, so no reader sees half a
record; creating one is exclusive locally, on NFS and over sshfs's SFTP ``symlink``):

- the **record** ``PATH`` (``.NAME.lock``, ``.NAME.read-<id>``, ``.owner/gen-N``): the holder
  (host, boot id, pid and its start time, thread, run id, lease, owner generation), created
  once and never rewritten;
- the **heartbeat** ``PATH.beat-<save id>``: a counter that only its holder writes, several
  times per lease, by renaming a fresh link onto it (an atomic replace, which sshfs, NFS and
  object stores all have; a link's mtime does not move over sshfs).

An observer never compares clocks. It judges a holder on another machine by its own monotonic
clock from the last change it saw (as Kubernetes leader election judges ``renewTime``): alive
as soon as the heartbeat changes, gone once it has watched the heartbeat stand still for a
whole lease. Hosts whose clocks disagree by minutes judge each other correctly.

Shortcuts for "certainly alive" or "certainly gone", never the only guard:

- same machine (host name *and* kernel boot id equal; containers on one kernel share a boot
  id but not a host name): the pid runs with the recorded start time, or not (pids are reused);
- same process: the thread that took it is this thread (it runs one save at a time, so that
  one ended), or has exited;
- another machine, same run (``TORCHELASTIC_RUN_ID``): an earlier attempt of this job, which
  its launcher has given up on; taken over at once;
- an owner generation below the taker's: a job that lost its output directory (``ownership``).

Anything else (a live process here, a heartbeat that moves) is a holder at work: the caller
gets :class:`CheckpointBusyError` naming it. Readers take a shared lease the same way,
``.NAME.read-<id>``, so that pruning skips a checkpoint being loaded (:func:`read_lease`).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import socket
import sys
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from fsdp_ext.checkpoint.location import posix_storage
from fsdp_ext.checkpoint.manifest import CheckpointBusyError, CheckpointPathError
from fsdp_ext.checkpoint.processes import boot_id, pid_running, process_start
from fsdp_ext.checkpoint.storage import DIRECTORY, LINK, CheckpointStorage, unobserved

__all__ = [
    "BEATS_PER_LEASE",
    "DEFAULT_LEASE_S",
    "MIN_LEASE_S",
    "CheckpointPrunedError",
    "LockOwner",
    "acquire",
    "check_lease",
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
BEATS_PER_LEASE = 4  # heartbeats per lease: a late beat or two never lets a live holder lapse
HEARTBEAT_MIN_S = 0.25  # the shortest heartbeat interval
MIN_LEASE_S = BEATS_PER_LEASE * HEARTBEAT_MIN_S
LEASE_ENV = "FSDP_EXT_LEASE_S"  # the lease in seconds for locks and owners this process takes
RUN_ID_ENV = "FSDP_EXT_RUN_ID"  # set by a launcher that outlives torchrun's own run ids
_READ = ".read-"
_BEAT = ".beat-"
_REMOVER = "remove-"  # save ids of remove_checkpoint's locks
RELEASED = "released"  # a heartbeat's last word: the holder gave it up


class CheckpointPrunedError(CheckpointPathError):
    """The checkpoint was pruned (or is being pruned) while it was to be read; try another."""


def check_lease(value: object, name: str = "lease_s") -> float:
    """``value`` as a lease in seconds, or one ValueError naming ``name`` and what it allows."""
    try:
        lease = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        lease = math.nan
    if isinstance(value, bool) or not (math.isfinite(lease) and lease >= MIN_LEASE_S):
        raise ValueError(
            f"{name} must be a finite number of seconds >= {MIN_LEASE_S:g} ({BEATS_PER_LEASE} "
            f"heartbeats of at least {HEARTBEAT_MIN_S:g} s each), got {value!r}"
        )
    return lease


def lease_seconds() -> float:
    """The lease this process gives its locks: ``$FSDP_EXT_LEASE_S``, else 60 s."""
    text = os.environ.get(LEASE_ENV)
    return DEFAULT_LEASE_S if text is None else check_lease(text, LEASE_ENV)


def heartbeat_interval(lease_s: float) -> float:
    return max(HEARTBEAT_MIN_S, lease_s / BEATS_PER_LEASE)


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
    since: float  # the holder's wall clock, for people only: no decision reads it
    run_id: str = ""
    lease_s: float = DEFAULT_LEASE_S
    generation: int = 0  # the output directory's owner generation it acts for (0: none)

    @classmethod
    def here(cls, save_id: str, *, lease_s: float | None = None, generation: int = 0) -> LockOwner:
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
            generation=generation,
        )

    def encode(self) -> str:
        return json.dumps({"kind": _KIND, **asdict(self)}, sort_keys=True)

    @classmethod
    def decode(cls, text: str) -> LockOwner | None:
        """The owner recorded in a lease's link text; None if it is not one of our records."""
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
        return f"{what} by pid {self.pid} on host {self.host}{run}, since {when} (its clock)"

    def on_this_machine(self) -> bool:
        """Same host name and same kernel boot: its pids are this machine's pids."""
        return bool(self.boot_id) and (self.host, self.boot_id) == (
            socket.gethostname(),
            boot_id(),
        )

    def same_run(self) -> bool:
        mine = run_id()
        return bool(mine) and self.run_id == mine

    def stale_reason(self) -> str | None:
        """Why the holder is certainly gone, or None when that takes watching its heartbeat
        (another machine) or it is certainly alive (this machine: :meth:`alive_here`)."""
        if not self.on_this_machine():
            if self.same_run():
                return (
                    f"it belongs to an earlier attempt of this run ({self.run_id}) on host "
                    f"{self.host}"
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
        return None


# ------------------------------------------------------------------------- heartbeats


def beat_path(record: Path, holder: LockOwner) -> Path:
    return record.with_name(f"{record.name}{_BEAT}{holder.save_id}")


def replace_link(fs: CheckpointStorage, path: Path, text: str) -> None:
    """Replace the link ``path`` with one holding ``text``, atomically (rename)."""
    tmp = path.with_name(f"{path.name}.tmp")
    with contextlib.suppress(FileNotFoundError):
        fs.unlink(tmp)
    fs.symlink(text, tmp)
    fs.rename(tmp, path)


def read_beat(fs: CheckpointStorage, record: Path, holder: LockOwner) -> str:
    """The holder's heartbeat text ("" before its first beat, or once it is removed)."""
    try:
        return fs.readlink(beat_path(record, holder))
    except (FileNotFoundError, OSError):
        return ""


def remove_beat(fs: CheckpointStorage, record: Path, holder: LockOwner) -> None:
    beat = beat_path(record, holder)
    for path in (beat, beat.with_name(f"{beat.name}.tmp")):
        with contextlib.suppress(FileNotFoundError):
            fs.unlink(path)


@dataclass
class _Held:
    fs: CheckpointStorage
    record: Path
    text: str
    holder: LockOwner
    still_mine: Callable[[], str | None] | None  # why it was lost (None: still held)
    beats: int = 0
    last_ok: float = field(default_factory=time.monotonic)
    warned: float = 0.0
    lost: str | None = None


@dataclass
class _Heartbeat:
    """One daemon thread per process renews every lease it holds. Its storage calls are not
    observed (:func:`~fsdp_ext.checkpoint.storage.unobserved`): they come at the thread's own
    times, so a crash test counting a save's operations never sees them."""

    held: dict[str, _Held] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    wake: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None

    def add(self, entry: _Held) -> _Held:
        with self.lock:
            self.held[str(entry.record)] = entry
            if self.thread is None or not self.thread.is_alive():
                self.thread = threading.Thread(
                    target=self._run, name="fsdp_ext-lease-heartbeat", daemon=True
                )
                self.thread.start()
        self.wake.set()
        return entry

    def remove(self, path: Path) -> _Held | None:
        with self.lock:  # never while a beat of it is being written
            return self.held.pop(str(path), None)

    def beat(self, entry: _Held) -> None:
        """One renewal: give up a record that is no longer ours, else bump the counter."""
        fs, now = entry.fs, time.monotonic()
        try:
            lost = None
            if fs.readlink(entry.record) != entry.text:
                lost = f"its record {entry.record} was replaced"
            elif entry.still_mine is not None:
                lost = entry.still_mine()
        except FileNotFoundError:
            lost = f"its record {entry.record} was removed"
        except OSError as exc:
            lost, failure = None, exc
        else:
            failure = None
            if lost is None:
                try:
                    replace_link(fs, beat_path(entry.record, entry.holder), str(entry.beats + 1))
                    entry.beats += 1
                    entry.last_ok = now
                    return
                except OSError as exc:
                    failure = exc
        if lost is not None:
            entry.lost = lost
            self.held.pop(str(entry.record), None)
            _say(f"lease {entry.record}: lost ({lost}); no longer renewing it")
            return
        silent = now - entry.last_ok
        if silent >= entry.holder.lease_s / 2 and now - entry.warned >= entry.holder.lease_s:
            entry.warned = now
            _say(
                f"lease {entry.record}: no heartbeat written for {silent:.0f} s "
                f"(lease {entry.holder.lease_s:g} s): {failure}; another job may take it over"
            )

    def _run(self) -> None:
        unobserved()
        while True:
            with self.lock:
                for entry in list(self.held.values()):
                    self.beat(entry)
                leases = [e.holder.lease_s for e in self.held.values()]
            self.wake.wait(heartbeat_interval(min(leases, default=DEFAULT_LEASE_S)))
            self.wake.clear()


_HEARTBEAT = _Heartbeat()


def _after_fork() -> None:  # a forked child holds none of its parent's leases
    global _HEARTBEAT
    _HEARTBEAT = _Heartbeat()


os.register_at_fork(after_in_child=_after_fork)


def hold(
    fs: CheckpointStorage,
    path: Path,
    owner: LockOwner,
    still_mine: Callable[[], str | None] | None = None,
) -> _Held:
    """Keep renewing ``path``'s lease for ``owner`` until :func:`let_go`. ``still_mine``
    (run before each beat) says why the lease was lost, or None; a lost lease stops."""
    return _HEARTBEAT.add(_Held(fs, path, owner.encode(), owner, still_mine))


def let_go(path: Path) -> None:
    _HEARTBEAT.remove(path)


def holding(path: Path) -> bool:
    """Whether this process holds (and renews) the lease at ``path``."""
    return str(path) in _HEARTBEAT.held


# ------------------------------------------------------------------------- watching


@dataclass
class _Seen:
    beat: str
    at: float  # monotonic, when this observer first saw ``beat``


# sleeps wait on an Event that is never set: under libfaketime with a real monotonic clock
# (how the clock-skew tests skew a host), time.sleep fails with EINVAL and Event.wait works
_NEVER = threading.Event()
# (record path, record text) -> the last heartbeat this process saw and when: an observer's
# memory, so that a prune that meets a read lease twice can tell a beat that stood still
_SEEN: dict[tuple[str, str], _Seen] = {}


def observe(
    fs: CheckpointStorage, record: Path, text: str, holder: LockOwner
) -> tuple[bool, float]:
    """(whether the heartbeat changed since this process last looked, seconds this process
    has seen it unchanged), by this process's monotonic clock only."""
    beat, now = read_beat(fs, record, holder), time.monotonic()
    seen = _SEEN.get((str(record), text))
    if seen is None or seen.beat != beat:
        _SEEN[(str(record), text)] = _Seen(beat, now)
        return seen is not None, 0.0
    return False, now - seen.at


def judge(fs: CheckpointStorage, record: Path, text: str, holder: LockOwner) -> str | None:
    """Why ``holder`` is gone, or None if it is (or may be) alive, looking once."""
    reason = holder.stale_reason()
    if reason is not None or holder.on_this_machine():
        return reason
    if read_beat(fs, record, holder) == RELEASED:
        return "it gave it up"
    changed, still = observe(fs, record, text, holder)
    if not changed and still > holder.lease_s:
        return (
            f"its lease expired: no heartbeat change from host {holder.host} seen for "
            f"{still:.0f} s (lease {holder.lease_s:g} s)"
        )
    return None


def watch(
    fs: CheckpointStorage, record: Path, *, what: str, outranks: int = 0
) -> tuple[str, LockOwner, str | None] | None:
    """Look at the holder of ``record`` until it is proven alive or gone: (its text, the
    holder, why it is gone or None if alive); None when the record vanished meanwhile.

    A holder on another machine is watched by this process's monotonic clock: alive once
    its heartbeat changes, gone once it stood still for a whole lease (plus one interval).
    ``outranks``: a holder of a lower owner generation is gone at once.
    """
    said = 0.0
    for key in [k for k in _SEEN if k[0] == str(record)]:
        del _SEEN[key]  # a change seen before this look proves nothing about now
    while True:
        try:
            text = fs.readlink(record)
        except FileNotFoundError:
            return None
        held = LockOwner.decode(text)
        if held is None:
            raise CheckpointBusyError(
                f"{record}: exists but is not a record made by fsdp_ext; remove it if "
                f"nothing else uses it, then try {what} again"
            )
        if outranks and 0 < held.generation < outranks:
            return (
                text,
                held,
                (f"its job lost the output directory (generation {held.generation} < {outranks})"),
            )
        if read_beat(fs, record, held) == RELEASED:
            return text, held, "it gave it up"
        reason = held.stale_reason()
        if reason is not None or held.on_this_machine():
            return text, held, reason
        changed, still = observe(fs, record, text, held)
        if changed:
            return text, held, None
        if still > held.lease_s + heartbeat_interval(held.lease_s):
            return (
                text,
                held,
                (
                    f"its lease expired: no heartbeat change from host {held.host} seen for "
                    f"{still:.0f} s (lease {held.lease_s:g} s)"
                ),
            )
        if time.monotonic() - said >= 5.0:
            said = time.monotonic()
            _say(
                f"{what}: held by {held.describe()} on another host; last seen change "
                f"{still:.0f} s ago; waiting until its lease ({held.lease_s:g} s) has passed "
                "with no heartbeat, unless one comes"
            )
        _NEVER.wait(min(0.25, held.lease_s / 8))


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

    Returns None when taken, or the live holder. ``what`` names the guarded thing in
    messages. A holder on another machine is watched for at most its lease and a heartbeat.
    """
    mine = owner.encode()
    while True:
        try:
            fs.symlink(mine, path)
            hold(fs, path, owner)
            return None
        except FileExistsError:
            pass
        seen = watch(fs, path, what=what, outranks=owner.generation)
        if seen is None:
            continue  # released meanwhile
        text, held, reason = seen
        if reason is None:
            return held
        warnings.warn(
            f"{what}: breaking the lock {path} of {held.describe()}: {reason}", stacklevel=3
        )
        # Move the stale lock aside under a name only this taker uses, then check that
        # what moved is the lock that was judged (another taker may have broken and
        # retaken it in between); if not, put it back.
        aside = path.with_name(f"{path.name}.stale-{owner.save_id}")
        if held.pid == os.getpid():
            let_go(path)  # this process's own, of a save that ended: stop its heartbeat
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
        remove_beat(fs, path, held)
        fs.unlink(aside)


def acquire(fs: CheckpointStorage, target: Path, owner: LockOwner) -> None:
    """Take the lock of ``target`` for ``owner``; break it only if its holder is gone."""
    path = lock_path(target)
    held = take(fs, path, owner, what=f"save to {target}")
    if held is not None:
        raise CheckpointBusyError(
            f"{target}: another save holds its lock {path} ({held.describe()}); two "
            "jobs must not save to one path. If that job is dead and this one cannot tell, "
            f"run `python -m fsdp_ext.checkpoint unlock {target}` and save again"
        )


def release(fs: CheckpointStorage, target: Path, owner: LockOwner) -> None:
    """Remove the lock if it is still ``owner``'s."""
    release_link(fs, lock_path(target), owner)


def release_link(fs: CheckpointStorage, path: Path, owner: LockOwner) -> None:
    let_go(path)
    try:
        if fs.readlink(path) == owner.encode():
            remove_beat(fs, path, owner)
            fs.unlink(path)
    except FileNotFoundError:
        pass


def is_beat_of(name: str, record_name: str) -> bool:
    return name.startswith(f"{record_name}{_BEAT}")


def remove_stray_beats(fs: CheckpointStorage, directory: Path, record_name: str) -> None:
    """Heartbeats of ``record_name`` whose holder no longer holds it (a holder killed while
    the record was broken, or a paused one that wrote one more beat after it)."""
    try:
        current = LockOwner.decode(fs.readlink(directory / record_name))
    except (FileNotFoundError, OSError):
        current = None
    keep = None if current is None else beat_path(directory / record_name, current).name
    for name in fs.listdir(directory):
        if is_beat_of(name, record_name) and keep is not None and name.startswith(keep):
            continue
        if is_beat_of(name, record_name) and fs.kind(directory / name) == LINK:
            with contextlib.suppress(FileNotFoundError):
                fs.unlink(directory / name)


def unlock(
    target: str | os.PathLike, fs: CheckpointStorage | None = None
) -> tuple[Path | None, LockOwner | None]:
    """Remove the lock of ``target`` whoever holds it (the manual last resort).

    ``target``: a checkpoint path or its ``.NAME.lock``. Returns the link removed (None: none
    there) and the holder it recorded (None: not one of ours, removed all the same). An
    output directory's owner is never removed by hand: its lease expires by itself.
    """
    fs = posix_storage(fs)
    target = Path(target)
    path = target if target.name.endswith(".lock") else lock_path(target)
    try:
        text = fs.readlink(path)
    except (FileNotFoundError, OSError):
        return None, None
    let_go(path)
    holder = LockOwner.decode(text)
    if holder is not None:
        remove_beat(fs, path, holder)
    fs.unlink(path)
    return path, holder


# ------------------------------------------------------------------------- read leases


def _is_read_lease(name: str, target: Path) -> bool:
    prefix = f".{target.name}{_READ}"
    return name.startswith(prefix) and _BEAT not in name and not name.endswith(".tmp")


def readers(fs: CheckpointStorage, target: Path) -> list[LockOwner]:
    """The live readers of ``target`` (those on another machine until this process has seen
    their heartbeat stand still for a lease); leases of readers that are gone are removed."""
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
        if holder is None:
            continue
        if holder.pid == os.getpid() or judge(fs, path, text, holder) is None:
            live.append(holder)
        else:
            remove_beat(fs, path, holder)
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
    fs = posix_storage(fs)
    target = Path(target)
    owner = LockOwner.here(f"read-{uuid.uuid4().hex[:12]}")
    path = target.parent / f".{target.name}{_READ}{owner.save_id[5:]}"
    fs.symlink(owner.encode(), path)
    hold(fs, path, owner)
    try:
        lock = lock_path(target)
        try:
            text = fs.readlink(lock)
            holder = LockOwner.decode(text)
        except FileNotFoundError:
            holder = None
        if (
            holder is not None
            and holder.save_id.startswith(_REMOVER)
            and judge(fs, lock, text, holder) is None
        ):
            raise CheckpointPrunedError(f"{target}: is being pruned ({holder.describe()})")
        if fs.kind(target) not in (LINK, DIRECTORY):
            raise CheckpointPrunedError(f"{target}: was pruned before it could be read")
        yield
    finally:
        release_link(fs, path, owner)
