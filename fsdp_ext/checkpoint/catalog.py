"""The catalog: the one object whose conditional replace publishes a checkpoint on a blob store.

A blob store has no rename, so a save cannot build a directory and swap it in. It writes
instead (the Delta Lake / Iceberg shape) every object of the new checkpoint under a fresh
version prefix ``step-N/v-<id>/`` that nothing names yet, and then publishes them all at
once with ONE conditional replace of ``catalog.json`` at the root, which maps each
published step to its version prefix. A reader resolves a step through the catalog, so it
sees the old version or the new, never a mix; a save killed before the commit leaves only
an unreferenced prefix, which the owner's next commit sweeps.

The catalog also carries the owner generation (claimed in ``fsdp_ext/job/blob_ownership.py``):
a commit whose writer's generation is below the catalog's raises
:class:`DirectoryFencedError`, and the replace is conditional on the ETag read at the start
of the commit, so a job that took the location over in between makes the stale writer's
replace fail; it then reads the catalog again and finds itself fenced. A counter makes every
catalog's bytes differ from every earlier one (ETags are the MD5 of the bytes, and A, B, A
would otherwise make an old ETag good again).

The catalog is sealed like the manifest (canonical JSON carrying the CRC-32 of its body), so
a flipped bit is named, never read as another mapping.
"""

from __future__ import annotations

import contextlib
import re
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace

from fsdp_ext.checkpoint.blob import BlobConditionError, BlobNotFoundError, BlobStore
from fsdp_ext.checkpoint.blob_lease import (
    READERS,
    ReadLease,
    leased_versions,
    live_readers,
    refuse_if_read,
)
from fsdp_ext.checkpoint.fence import DirectoryFencedError
from fsdp_ext.checkpoint.lock import CheckpointPrunedError, LockOwner
from fsdp_ext.checkpoint.manifest import CheckpointIntegrityError, seal, unseal

__all__ = [
    "CATALOG_KEY",
    "BlobFence",
    "Catalog",
    "commit",
    "new_version_prefix",
    "read_catalog",
    "remove_step",
    "sweep",
    "version_prefix_of",
]

CATALOG_KEY = "catalog.json"
FORMAT = "fsdp_ext.catalog/1"
_SEAL = "catalog_crc32"
_KEYS = frozenset({"format", "generation", "counter", "owner", "steps"})
# what a version prefix looks like (step, the writer's owner generation, a random id): only
# keys of this shape are ever swept, and only by a writer of that generation or a later one
_VERSION = re.compile(r"step-(\d+)/v-(\d+)-([0-9a-f]{8,32})")
_COMMIT_RETRIES = 20  # racing writers that are not fenced (plain dcp.save) take turns


@dataclass(frozen=True)
class Catalog:
    """The published state of a location: step -> version prefix, plus the owner fence."""

    generation: int = 0  # the owner generation that last claimed the location (0: none)
    counter: int = 0  # raised by every commit
    owner: str = ""  # the owner's description, for messages only
    steps: dict[int, str] = field(default_factory=dict)

    def to_bytes(self) -> bytes:
        body = {
            "format": FORMAT,
            "generation": self.generation,
            "counter": self.counter,
            "owner": self.owner,
            "steps": {str(s): p for s, p in sorted(self.steps.items())},
        }
        return seal(body, _SEAL).encode()

    @classmethod
    def from_bytes(cls, data: bytes, source: str) -> Catalog:
        try:
            raw = unseal(data.decode("utf-8"), _SEAL, _KEYS)
            if raw["format"] != FORMAT:
                raise ValueError(f"format {raw['format']!r}")
            steps = {}
            for step, prefix in raw["steps"].items():
                m = _VERSION.fullmatch(prefix) if isinstance(prefix, str) else None
                if m is None or m.group(1) != step:
                    raise ValueError(f"step {step!r} maps to {prefix!r}")
                steps[int(step)] = prefix
            for name in ("generation", "counter"):
                if not isinstance(raw[name], int) or isinstance(raw[name], bool) or raw[name] < 0:
                    raise TypeError(f"{name} is {raw[name]!r}")
            if not isinstance(raw["owner"], str):
                raise TypeError(f"owner is {raw['owner']!r}")
            return cls(raw["generation"], raw["counter"], raw["owner"], steps)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointIntegrityError(
                f"{source}: not a readable catalog ({type(exc).__name__}: {exc}); the "
                "checkpoints under it are unreachable until it is restored"
            ) from exc


def read_catalog(store: BlobStore) -> tuple[Catalog, str | None]:
    """The catalog and the ETag to replace it with (None: there is none yet, an empty one).

    The ETag is the store's (``head``), never computed from the bytes: an S3 server may give
    any opaque string. ``head`` comes first: were the bytes read newer than that ETag, the
    object changed after it, so ``replace_if`` with it fails (every catalog write bumps its
    counter, so an old ETag never comes back)."""
    info = store.head(CATALOG_KEY)
    if info is None:
        return Catalog(), None
    try:
        data = store.get(CATALOG_KEY)
    except BlobNotFoundError:
        return Catalog(), None
    return Catalog.from_bytes(data, store.where(CATALOG_KEY)), info.etag


def new_version_prefix(step: int, generation: int, version_id: str) -> str:
    """``step-N/v-<generation>-<id>``: where a save of step N by a writer of that owner
    generation writes before its commit."""
    prefix = f"step-{step}/v-{generation}-{version_id}"
    if _VERSION.fullmatch(prefix) is None:
        raise ValueError(
            f"step {step!r} / generation {generation!r} / version id {version_id!r} make no "
            "version prefix"
        )
    return prefix


def version_prefix_of(key: str) -> str | None:
    """The version prefix a key lies under, or None when it is no key of a version."""
    parts = key.split("/")
    if len(parts) < 3:
        return None
    prefix = "/".join(parts[:2])
    return prefix if _VERSION.fullmatch(prefix) else None


def commit(
    store: BlobStore,
    change: Callable[[Catalog], Catalog],
    *,
    generation: int | None,
) -> Catalog:
    """Apply ``change`` to the catalog in one conditional replace; returns the new catalog.

    ``generation``: the owner generation the writer acts for (None: no owner, plain
    ``dcp.save``); a catalog of a higher generation raises :class:`DirectoryFencedError`
    and nothing is written. A replace that loses a race reads again and retries.
    """
    for _attempt in range(_COMMIT_RETRIES):
        current, etag = read_catalog(store)
        check_fence(store, current, generation)
        new = change(current)
        new = replace(new, counter=current.counter + 1)
        try:
            if etag is None:
                store.put_if_absent(CATALOG_KEY, new.to_bytes())
            else:
                store.replace_if(CATALOG_KEY, new.to_bytes(), etag)
            return new
        except BlobConditionError:
            continue  # another writer committed in between: read it again
    raise BlobConditionError(
        f"{store.where(CATALOG_KEY)}: the catalog changed under {_COMMIT_RETRIES} commits in a "
        "row; another job writes this location (give each job its own location)"
    )


def check_fence(store: BlobStore, catalog: Catalog, generation: int | None) -> None:
    """Raise :class:`DirectoryFencedError` when the catalog's owner outranks ``generation``."""
    if generation is not None and catalog.generation > generation:
        raise DirectoryFencedError(
            f"{store.location}: taken over by {catalog.owner or 'another job'} (owner "
            f"generation {catalog.generation}; this job's is {generation}); this job writes "
            "nothing more there. It was paused, or could not renew its lease, for longer "
            "than its lease"
        )


@dataclass(frozen=True)
class BlobFence:
    """What a save must hold to commit at ``store``: owner generation ``generation``."""

    store: BlobStore
    generation: int

    def lost(self) -> str | None:
        """Why this generation no longer owns the location (None: it still does)."""
        try:
            check_fence(self.store, read_catalog(self.store)[0], self.generation)
        except DirectoryFencedError as exc:
            return str(exc)
        return None

    def check(self) -> None:
        why = self.lost()
        if why is not None:
            raise DirectoryFencedError(why)


def remove_step(store: BlobStore, step: int, *, generation: int | None) -> bool:
    """Unpublish ``step`` (one commit), then delete its objects; False when it was not
    published.

    A step whose version a live reader leases (``blob_lease.py``) is left published and
    whole: :class:`CheckpointBusyError` names the reader, as a prune on POSIX does, and a
    later prune removes it. The commit comes first, so a prune killed midway leaves only
    unreferenced objects (swept later), never a published step with objects missing; after
    it the leases are listed again, and a version a reader leased in between keeps its
    objects until a later sweep."""
    prefix = read_catalog(store)[0].steps.get(step)
    if prefix is None:
        return False
    refuse_if_read(store, prefix, f"{store.where(prefix)} (step {step})")
    gone: list[str] = []

    def drop(catalog: Catalog) -> Catalog:
        gone[:] = [catalog.steps[step]] if step in catalog.steps else []
        return replace(catalog, steps={s: p for s, p in catalog.steps.items() if s != step})

    commit(store, drop, generation=generation)
    for prefix in gone:
        if store.list(f"{READERS}{prefix}/") and live_readers(store, prefix):
            continue  # leased between the first look and the commit: swept once let go
        for key in store.list(prefix + "/"):
            store.delete(key)
    return bool(gone)


@contextlib.contextmanager
def read_lease(store: BlobStore, step: int, *, lease_s: float | None = None) -> Iterator[str]:
    """Hold a read lease on the published version of ``step`` (yields its prefix): a prune
    leaves it whole meanwhile. Raises :class:`CheckpointPrunedError` when the step is not,
    or no longer, published."""
    prefix = read_catalog(store)[0].steps.get(step)
    if prefix is None:
        raise CheckpointPrunedError(f"{store.location}: step {step} is not published")
    owner = LockOwner.here(f"read-{uuid.uuid4().hex[:12]}", lease_s=lease_s)
    lease = ReadLease(store, f"{READERS}{prefix}/{owner.save_id}", owner)
    lease.start()
    try:
        if read_catalog(store)[0].steps.get(step) != prefix:  # pruned before the lease landed
            raise CheckpointPrunedError(
                f"{store.location}: step {step} was pruned before it could be read"
            )
        yield prefix
    finally:
        lease.close()


def sweep(
    store: BlobStore, catalog: Catalog, *, generation: int, keep: set[str] = frozenset()
) -> list[str]:
    """Delete every object of a version the catalog does not name (dead or replaced saves)
    written by owner ``generation`` or an earlier one, except under the prefixes in ``keep``.
    A later generation's versions are never touched: a stale job that committed just before
    a takeover and sweeps after it must not delete the new owner's save in flight. Only keys
    shaped like a version's are touched. Returns the keys deleted."""
    keys = store.list()  # one listing for the read leases and the versions' objects: it runs
    # after every commit, before the save returns, so each request is a save's time
    live = set(catalog.steps.values()) | set(keep) | leased_versions(keys)

    def dead(key: str) -> bool:
        prefix = version_prefix_of(key)
        if prefix is None or prefix in live:
            return False
        return int(_VERSION.fullmatch(prefix).group(2)) <= generation

    removed = []
    for key in keys:
        if dead(key):
            store.delete(key)
            removed.append(key)
    store.abort_uploads("step-", dead)  # a killed writer's unfinished multipart uploads
    return removed
