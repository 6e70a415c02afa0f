"""Read leases on a blob store (S3 or POSIX alike): a load holds one, and a prune leaves
what a live reader holds.

A reader (:func:`~fsdp_ext.checkpoint.catalog.read_lease`) of the version
``step-N/v-G-ID`` puts ``readers/step-N/v-G-ID/<lease id>`` (its
:class:`~fsdp_ext.checkpoint.lock.LockOwner` and a counter), then reads the catalog: were
the step unpublished by then, it takes the lease back and raises
:class:`~fsdp_ext.checkpoint.lock.CheckpointPrunedError` (the resume tries the next older
step). A thread rewrites the lease every heartbeat interval with the next counter, so its
ETag changes (ETags are only compared: any opaque string will do).

A remover (:func:`~fsdp_ext.checkpoint.catalog.remove_step`) refuses a step whose version
has a live reader (:func:`refuse_if_read`: :class:`CheckpointBusyError` naming the reader,
as a prune on POSIX does) and changes nothing; after its commit it lists the leases again,
and the objects of a version a reader leased in between are not deleted (the commit's sweep
deletes them once no lease remains). One of the two always sees the other: the reader's
lease comes before its look at the catalog, the remover's second look after its commit.

Liveness is judged as a POSIX read lease's (``lock.readers``): a holder on this machine is
alive while its process runs (this process: always) and dead at once when it has exited;
one on another machine is alive if its lease's ETag changes while the judge watches, by its
own monotonic clock, for one lease plus one heartbeat interval; else it has expired. Never
an mtime, never a wall clock. A dead or expired reader's lease is deleted.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterable

from fsdp_ext.checkpoint.blob import BlobError, BlobStore
from fsdp_ext.checkpoint.lock import LockOwner, heartbeat_interval
from fsdp_ext.checkpoint.manifest import CheckpointBusyError

__all__ = ["READERS", "ReadLease", "leased_versions", "live_readers", "refuse_if_read"]

READERS = "readers/"


class ReadLease:
    """One reader's lease on ``key``, renewed by a thread until :meth:`close`."""

    def __init__(self, store: BlobStore, key: str, owner: LockOwner):
        self.store, self.key, self.owner = store, key, owner
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fsdp_ext-read-lease", daemon=True)

    def _record(self, counter: int) -> bytes:
        return f"{self.owner.encode()}\n{counter}".encode()

    def start(self) -> None:
        self.store.put_if_absent(self.key, self._record(0))
        self._thread.start()

    def _run(self) -> None:
        interval, counter = heartbeat_interval(self.owner.lease_s), 0
        while not self._stop.wait(interval):
            counter += 1
            with contextlib.suppress(BlobError, OSError):  # a missed beat; the next may land
                self.store.put(self.key, self._record(counter))

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        with contextlib.suppress(BlobError, OSError):  # else it expires
            self.store.delete(self.key)


def _judge(store: BlobStore, key: str) -> LockOwner | None:
    """The holder of the lease ``key`` if it is alive; a dead or expired one is deleted."""
    info = store.head(key)
    if info is None:
        return None
    try:
        text = store.get(key).decode("utf-8", "replace").rpartition("\n")[0]
    except BlobError:
        return None
    holder = LockOwner.decode(text)
    if holder is not None and holder.pid == os.getpid() and holder.on_this_machine():
        return holder  # this process's own: it takes its lease back itself
    if holder is not None and holder.stale_reason() is None:
        if holder.on_this_machine():
            return holder  # its process runs
        limit = holder.lease_s + heartbeat_interval(holder.lease_s)
        since = time.monotonic()
        while time.monotonic() - since <= limit:
            now = store.head(key)
            if now is None:
                return None  # taken back meanwhile
            if now.etag != info.etag:
                return holder  # a beat since the first look: alive
            time.sleep(min(0.1, heartbeat_interval(holder.lease_s) / 4))
    with contextlib.suppress(BlobError, OSError):
        store.delete(key)
    return None


def live_readers(store: BlobStore, prefix: str) -> list[LockOwner]:
    """The live holders of read leases on the version ``prefix`` (judged; the dead and
    expired leases are deleted)."""
    keys = store.list(f"{READERS}{prefix}/")
    return [h for h in (_judge(store, k) for k in keys) if h is not None]


def leased_versions(keys: Iterable[str]) -> set[str]:
    """The version prefixes with any read lease among ``keys`` (a listing of the store;
    unjudged): what a sweep must not delete."""
    return {k[len(READERS) :].rpartition("/")[0] for k in keys if k.startswith(READERS)}


def refuse_if_read(store: BlobStore, prefix: str, what: str) -> None:
    """Raise :class:`CheckpointBusyError` naming the reader when a live one leases the
    version ``prefix`` (``what``: the step, for the message), as ``lock.refuse_if_read``
    does on POSIX; call it before unpublishing anything."""
    found = live_readers(store, prefix)
    if found:
        raise CheckpointBusyError(
            f"{what}: being read by {found[0].describe()}; not removing it now (the next "
            "prune will)"
        )
