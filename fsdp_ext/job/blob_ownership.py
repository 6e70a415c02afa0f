"""One owner per blob location: owner generations, heartbeats and the fence, on conditional puts.

The POSIX version (``ownership.py``, beside this) uses symlinks and renames; here the same
rules stand on the blob primitives alone:

- a job claims the location by creating ``.owner/gen-N`` with ``put_if_absent`` (of racing
  claimants exactly one gets N), then raising the catalog's generation to N with one
  conditional replace (``catalog.commit``). From then on any commit of a lower generation is
  refused (:class:`DirectoryFencedError`): a paused stale job can never publish;
- the holder rewrites ``.owner/gen-N.beat`` several times per lease, with a counter, so each
  beat has new bytes and so a new ETag;
- a claimant judges a holder by its own monotonic clock only: alive once the beat's ETag
  changes, gone once it saw the same ETag for a whole lease (plus one interval). No mtime,
  no wall clock. A holder on this machine whose process has exited is gone at once, and one
  that released the location (its last beat says so) too.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
import uuid
import warnings
from dataclasses import dataclass, field, replace

from fsdp_ext.checkpoint.blob import BlobError, BlobExistsError, BlobStore
from fsdp_ext.checkpoint.catalog import BlobFence, Catalog, commit, read_catalog
from fsdp_ext.checkpoint.fence import DirectoryFencedError
from fsdp_ext.checkpoint.lock import (
    RELEASED,
    LockOwner,
    check_lease,
    heartbeat_interval,
)
from fsdp_ext.job.ownership import DirectoryOwnedError

__all__ = ["BlobOwnership", "beat_key", "claim_blob", "judge_beat", "record_key"]

OWNER_PREFIX = ".owner/"


def record_key(generation: int) -> str:
    return f"{OWNER_PREFIX}gen-{generation:08d}"


def beat_key(generation: int) -> str:
    return record_key(generation) + ".beat"


@dataclass
class BlobOwnership:
    """This job's claim on a blob location, and the heartbeat thread that renews it."""

    store: BlobStore
    owner: LockOwner
    joined: bool = False  # the record of this run's launcher, left to that launcher
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    @property
    def fence(self) -> BlobFence:
        return BlobFence(self.store, self.owner.generation)

    def start(self) -> None:
        if self.joined:
            return
        self._beat(0)
        self._thread = threading.Thread(target=self._run, name="fsdp_ext-blob-lease", daemon=True)
        self._thread.start()

    def _beat(self, counter: int) -> None:
        self.store.put(beat_key(self.owner.generation), f"{self.owner.save_id} {counter}".encode())

    def _run(self) -> None:
        interval, counter = heartbeat_interval(self.owner.lease_s), 0
        while not self._stop.wait(interval):
            counter += 1
            with contextlib.suppress(BlobError, OSError):  # a missed beat; the next may land
                if self.fence.lost() is not None:
                    return  # another generation owns it: this job counts as fenced
                self._beat(counter)

    def stop_renewing(self) -> None:
        """Stop the heartbeat but keep the record: how a job that dies looks to others."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def release(self) -> None:
        """Give the location up (a finished job): a later job takes it at once."""
        if self.joined:
            return
        self.stop_renewing()
        with contextlib.suppress(BlobError, OSError):  # a store that died: the lease expires
            if self.fence.lost() is None:
                self.store.put(beat_key(self.owner.generation), RELEASED.encode())


def judge_beat(store: BlobStore, generation: int, holder: LockOwner, *, what: str) -> str | None:
    """Watch the holder of ``generation`` until it is proven alive (None) or gone (why)."""
    key, lease = beat_key(generation), holder.lease_s
    with contextlib.suppress(BlobError):
        if store.get(key) == RELEASED.encode():
            return "it gave it up"
    reason = holder.stale_reason()
    if reason is not None:
        return reason
    limit = lease + heartbeat_interval(lease)
    seen, since, said = None, time.monotonic(), 0.0
    while True:
        info = store.head(key)
        if info is not None and info.size == len(RELEASED):
            with contextlib.suppress(BlobError):
                if store.get(key) == RELEASED.encode():
                    return "it gave it up"
        etag = None if info is None else info.etag
        now = time.monotonic()
        if seen is None:
            seen = (etag,)
        elif etag != seen[0]:
            return None  # a beat since the first look: alive
        if now - since > limit:
            return (
                f"its lease expired: no heartbeat change from host {holder.host} seen for "
                f"{now - since:.0f} s (lease {lease:g} s)"
            )
        if now - said >= 5.0 and now - since > 1.0:
            said = now
            print(
                f"fsdp_ext.checkpoint: {what}: held by {holder.describe()}; waiting until its "
                f"lease ({lease:g} s) has passed with no heartbeat, unless one comes",
                file=sys.stderr,
                flush=True,
            )
        time.sleep(min(0.25, lease / 8))


def claim_blob(store: BlobStore, *, lease_s: float | None = None) -> BlobOwnership:
    """Make this job the owner of the blob location, or raise :class:`DirectoryOwnedError`
    naming the live owner."""
    if lease_s is not None:
        lease_s = check_lease(lease_s)
    me = LockOwner.here(f"owner-{uuid.uuid4().hex[:12]}", lease_s=lease_s)
    what = f"checkpoint location {store.location}"
    for _attempt in range(20):
        catalog, _etag = read_catalog(store)
        top = catalog.generation
        if top:
            holder = _holder(store, top)
            if holder is not None:
                if holder.same_run() and holder.on_this_machine() and not holder.stale_reason():
                    return BlobOwnership(store, holder, joined=True)  # our own launcher
                reason = judge_beat(store, top, holder, what=what)
                if reason is None:
                    raise DirectoryOwnedError(
                        f"{store.location}: owned by a live job, {holder.describe()} (lease "
                        f"{holder.lease_s:g} s, heartbeat seen changing); two jobs must not "
                        "write one checkpoint location. Wait for that job to end or stop it, "
                        "or choose another location"
                    )
                if reason != "it gave it up":
                    warnings.warn(
                        f"{what}: taking it over from {holder.describe()}: {reason}",
                        stacklevel=2,
                    )
        mine = replace(me, generation=top + 1)
        try:
            store.put_if_absent(record_key(mine.generation), mine.encode().encode())
        except BlobExistsError:
            # another claimant took this generation first (or one died between its record
            # and its catalog commit): judge that one next
            if read_catalog(store)[0].generation == top:
                _raise_generation(store, top + 1)
            continue
        ownership = BlobOwnership(store, mine)
        ownership.start()  # beating before the catalog names us: a claimant watching sees it

        def take(current: Catalog, gen: int = mine.generation, who: str = mine.describe()):
            return replace(current, generation=gen, owner=who)

        try:
            commit(store, take, generation=mine.generation)
        except DirectoryFencedError:
            ownership.stop_renewing()
            continue
        for key in store.list(OWNER_PREFIX):  # earlier generations' records and beats
            gen = key[len(OWNER_PREFIX) :].split(".")[0].removeprefix("gen-")
            if gen.isdigit() and int(gen) < mine.generation:
                store.delete(key)
        return ownership
    raise DirectoryOwnedError(f"{store.location}: could not claim it (too many racing claimants)")


def _raise_generation(store: BlobStore, generation: int) -> None:
    """A claimant that died after its record and before its commit left ``generation``'s
    record; raise the catalog to it so that the next claim judges that holder."""
    holder = _holder(store, generation)
    owner = holder.describe() if holder is not None else ""
    with contextlib.suppress(DirectoryFencedError):
        commit(
            store,
            lambda c: replace(c, generation=max(c.generation, generation), owner=owner),
            generation=generation,
        )


def _holder(store: BlobStore, generation: int) -> LockOwner | None:
    try:
        return LockOwner.decode(store.get(record_key(generation)).decode("utf-8", "replace"))
    except (BlobError, OSError):
        return None


def blob_owner_gone(store: BlobStore) -> str | None:
    """Why the job owning the blob location is certainly gone (it released it, none ever
    owned it, or its process on this machine exited), looking once; None when it may be
    alive. The blob twin of :func:`fsdp_ext.job.ownership.owner_gone`."""
    generation = read_catalog(store)[0].generation
    if not generation:
        return f"no job owns {store.location}"
    owner = _holder(store, generation)
    if owner is None:
        return None
    with contextlib.suppress(BlobError):
        if store.get(beat_key(generation)) == RELEASED.encode():
            return f"its job released {store.location}"
    if owner.on_this_machine() and owner.pid != os.getpid():
        return owner.stale_reason()
    return None
