"""The overwrite protocol: where a checkpoint path's files live, and how a save replaces them.

A save writes a complete new version in a directory beside the path, ``.NAME.v-<save id>``
(every rank's files, ``.metadata``, the manifest, all fsynced), then publishes it in one
atomic step. Which step depends on what the filesystem can do, found out once per
filesystem by trying it (:meth:`CheckpointStorage.can_exchange`):

- **swap** (ext4, xfs, btrfs, tmpfs): the path is a real directory. The first save renames
  the version onto it; an overwrite swaps the two with ``renameat2(RENAME_EXCHANGE)``, so the
  old checkpoint ends up under the version's name and is removed. ``shutil.rmtree``,
  ``TemporaryDirectory`` and ``cp -r`` treat the path as the plain directory it is.
- **link** (sshfs, some NFS: no RENAME_EXCHANGE): the path is a symbolic link to the version,
  and a publish renames a new link onto it (rename(2) replaces a link atomically, locally and
  over sshfs's posix-rename). The stock ``FileSystemReader`` follows the link.
- **in place**: the path is a directory holding files this writer did not write (a
  ``model.pt``, a stock DCP checkpoint), or one of ours on a filesystem that cannot swap.
  Then the save writes beside them, as stock DCP does, and commits by renaming the manifest
  and then ``.metadata`` into place, last. Its data files carry the save id in their names
  (``__0_other.s-<save id>.distcp``), so they never overwrite a file the previous
  ``.metadata`` needs; those of earlier saves of ours go once the new one is committed.
  Nothing else at the path is ever moved or deleted.

Cleanup deletes only what it can prove is its own: version directories whose plan or
manifest names this target, links to them, in-place files named with a save id, and entries
named ``.fsdp_ext-trash-*``; only while holding the path's lock. Removing a directory first
renames it to a trash name in one atomic step, so a kill during the deletion leaves only
trash, which the next save or prune of any checkpoint in the same directory removes.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from pathlib import Path

from fsdp_ext.checkpoint.fence import Fence
from fsdp_ext.checkpoint.location import posix_storage
from fsdp_ext.checkpoint.lock import (
    LockOwner,
    acquire,
    is_beat_of,
    lock_path,
    refuse_if_read,
    release,
    remove_stray_beats,
)
from fsdp_ext.checkpoint.manifest import (
    MANIFEST_NAME,
    METADATA_NAME,
    PLAN_NAME,
    CheckpointBusyError,
    CheckpointIntegrityError,
    CheckpointPathError,
    Manifest,
)
from fsdp_ext.checkpoint.storage import DIRECTORY, FILE, LINK, MISSING, CheckpointStorage

_VERSION = ".v-"
TRASH_PREFIX = ".fsdp_ext-trash-"
# the tail of an in-place data file's name: ``.s-<save id>.distcp``
_IN_PLACE_FILE = re.compile(r"^__\d+_.*\.s-\d{8}T\d{6}-[0-9a-f]{8}\.distcp$")
# in-place bookkeeping a killed save leaves in the path: ours by name, only under a plan
METADATA_TEMP = f"{METADATA_NAME}.fsdp_ext-tmp"
MANIFEST_TEMP = f"{MANIFEST_NAME}.tmp"
_DONE = re.compile(r"^\.done-rank\d+\.json$")

SWAP, LINKED, IN_PLACE = "swap", "link", "in place"


class CheckpointExistsError(CheckpointPathError):
    """``overwrite=False`` and a checkpoint is at the path: stock DCP's RuntimeError, with
    its message."""


def version_name(target_name: str, save_id: str) -> str:
    return f".{target_name}{_VERSION}{save_id}"


def is_version_name(name: str, target_name: str) -> bool:
    prefix = f".{target_name}{_VERSION}"
    return name.startswith(prefix) and len(name) > len(prefix) and "/" not in name


def link_temp_name(target_name: str, save_id: str) -> str:
    return f".{target_name}.link-{save_id}"


def probe_name(target_name: str, save_id: str) -> str:
    return f".{target_name}.probe-{save_id}"


def in_place_file_name(base: str, save_id: str, suffix: str) -> str:
    """``__0_other`` -> ``__0_other.s-<save id>.distcp``: unique to one save."""
    return f"{base}.s-{save_id}{suffix}"


@dataclass
class Version:
    """A version directory of a checkpoint path, described by its own records."""

    name: str
    save_id: str
    complete: bool  # has its manifest: every rank finished and .metadata was written
    replaces: str | None
    plan: dict | None  # the plan record of an unfinished save


def read_version(fs: CheckpointStorage, target: Path, name: str) -> Version | None:
    """The version ``name`` beside ``target`` if its records say it is one; else None."""
    if not is_version_name(name, target.name):
        return None
    directory = target.parent / name
    if fs.kind(directory) != DIRECTORY:
        return None
    if fs.kind(directory / MANIFEST_NAME) == FILE:
        manifest = _read_manifest(fs, directory)
        if manifest is None or manifest.target != target.name:
            return None
        return Version(name, manifest.save_id, True, manifest.replaces, None)
    if fs.kind(directory / PLAN_NAME) == FILE:
        try:
            plan = json.loads(fs.read_bytes(directory / PLAN_NAME).decode())
            if plan.get("target") != target.name:
                return None
            return Version(name, str(plan["save_id"]), False, plan.get("replaces"), plan)
        except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError):
            return None
    return None


def _read_manifest(fs: CheckpointStorage, directory: Path) -> Manifest | None:
    try:
        raw = fs.read_bytes(directory / MANIFEST_NAME).decode()
        return Manifest.from_json(raw, str(directory / MANIFEST_NAME))
    except (CheckpointIntegrityError, UnicodeDecodeError, FileNotFoundError):
        return None


def versions(fs: CheckpointStorage, target: Path) -> list[Version]:
    """Every version directory beside ``target`` that its records prove is one."""
    if fs.kind(target.parent) != DIRECTORY:
        return []
    found = (read_version(fs, target, name) for name in fs.listdir(target.parent))
    return [v for v in found if v is not None]


@dataclass
class Target:
    """What is at a checkpoint path before a save: ``kind`` is ``missing``, ``empty``, ``link``
    (to our version ``version``), ``ours`` (a directory holding only what our manifest
    lists) or ``foreign`` (a directory holding anything else)."""

    kind: str
    version: str | None = None
    manifest: Manifest | None = None

    @property
    def save_id(self) -> str | None:
        return self.manifest.save_id if self.manifest is not None else None


def inspect_target(fs: CheckpointStorage, target: Path, *, overwrite: bool = True) -> Target:
    """What is at ``target``. Raises, naming the path and what to do, with nothing written:
    :class:`CheckpointPathError` for what a checkpoint cannot replace (a regular file, a
    link elsewhere); :class:`CheckpointExistsError` (stock's ``RuntimeError`` and message)
    under ``overwrite=False`` when a checkpoint is there."""
    kind = fs.kind(target)
    if kind == MISSING:
        return Target("missing")
    if kind == LINK:
        name = fs.readlink(target)
        if not is_version_name(name, target.name):
            raise CheckpointPathError(
                f"{target}: is a symbolic link to {name!r}, not to a version directory "
                f"SpreadFileSystemWriter made; it will not replace it. Remove the link or "
                "choose another path"
            )
        _refuse_existing(target, overwrite)
        return Target("link", version=name)
    if kind != DIRECTORY:
        raise CheckpointPathError(
            f"{target}: is a {'regular file' if kind == FILE else 'special file'}, not a "
            "checkpoint directory; it will not be replaced. Remove it or choose another path"
        )
    entries = fs.listdir(target)
    if not entries:
        return Target("empty")
    manifest = None
    if MANIFEST_NAME in entries and fs.kind(target / MANIFEST_NAME) == FILE:
        manifest = _read_manifest(fs, target)
        if manifest is not None and manifest.target != target.name:
            manifest = None  # copied here from another path: its cleanup rules do not hold
    if METADATA_NAME in entries or manifest is not None:
        _refuse_existing(target, overwrite)
    ours = manifest is not None and set(entries) <= {
        METADATA_NAME,
        MANIFEST_NAME,
        *manifest.files,
    }
    return Target("ours" if ours else "foreign", manifest=manifest)


def _refuse_existing(target: Path, overwrite: bool) -> None:
    if not overwrite:
        raise CheckpointExistsError(
            "Checkpoint already exists and self.overwrite=False. "
            f"({target}; pass overwrite=True to replace it, or choose another path)"
        )


def choose_layout(fs: CheckpointStorage, target: Path, found: Target, save_id: str) -> str:
    """``SWAP``, ``LINKED`` or ``IN_PLACE`` for a save over ``found`` (see the module doc)."""
    if found.kind == "foreign":
        return IN_PLACE
    swap = fs.can_exchange(target.parent, probe_name(target.name, save_id))
    if found.kind == "ours" and not swap:
        return IN_PLACE
    return SWAP if swap else LINKED


def publish(
    fs: CheckpointStorage,
    target: Path,
    version: str,
    save_id: str,
    sync: bool,
    layout: str,
    scratch: Path | None = None,
) -> None:
    """Make ``version`` the checkpoint at ``target`` in one atomic step.

    ``scratch``: the owner generation's work directory (``ownership.Fence``), where the
    version was staged; every step here then takes its source from it, so once a takeover
    has removed it, nothing of this save can land at ``target``."""
    staging = (scratch or target.parent) / version
    if layout == SWAP:
        if fs.kind(target) in (MISSING, DIRECTORY) and not _has_entries(fs, target):
            fs.rename(staging, target)  # rename(2) replaces an empty directory
        else:
            fs.exchange(staging, target)  # the old checkpoint (or link) now at ``staging``
    else:
        if scratch is not None:  # the link's version lives beside the path, like the path
            fs.rename(staging, target.parent / version)
        link = (scratch or target.parent) / link_temp_name(target.name, save_id)
        fs.symlink(version, link)
        if fs.kind(target) == DIRECTORY:
            fs.rmdir(target)  # empty (checked under the lock); rename cannot replace a directory
        fs.rename(link, target)
    if sync:
        fs.fsync(target.parent)
    if layout == SWAP and fs.kind(staging) == LINK:
        fs.unlink(staging)  # the link layout's path, swapped out; its version goes below
    elif layout == SWAP and fs.kind(staging) == DIRECTORY:
        discard(fs, staging)  # the previous checkpoint


def _has_entries(fs: CheckpointStorage, path: Path) -> bool:
    return fs.kind(path) == DIRECTORY and bool(fs.listdir(path))


def discard(fs: CheckpointStorage, path: Path, scratch: Path | None = None) -> None:
    """Remove a directory: renamed to a trash name first (one atomic step), then deleted;
    a kill meanwhile leaves only trash, which :func:`sweep_directory` removes. ``scratch``
    (an owner generation's work directory) holds the trash: a fenced job's rename fails."""
    trash = (scratch or path.parent) / f"{TRASH_PREFIX}{uuid.uuid4().hex}"
    fs.rename(path, trash)
    fs.remove_tree(trash, missing_ok=True)


def remove_leftovers(
    fs: CheckpointStorage,
    target: Path,
    *,
    keep: str | None,
    published: bool,
    scratch: Path | None = None,
) -> None:
    """Remove what earlier saves of ``target`` left behind; call only under its lock.

    Before this save's publish (``published=False``) only unfinished versions go: a complete
    one might be what the path points to, if this node sees the link late (sshfs caches links
    for up to 20 s). After it, every version but ``keep``, which the path now points to.
    Trash, and what a killed save or prune left of other checkpoints in the same directory,
    go too (:func:`sweep_directory`).
    """
    parent = target.parent
    for name in fs.listdir(parent):
        if name == keep:
            continue
        path = parent / name
        if name.startswith(TRASH_PREFIX):
            fs.remove_tree(path, missing_ok=True)  # renamed there whole, then killed
            continue
        if name.startswith((f".{target.name}.link-", f".{target.name}.probe-")):
            _remove_link_or_empty(fs, path, target)
            continue
        if is_beat_of(name, lock_path(target).name):
            continue  # the lock's heartbeats: remove_stray_beats below
        if name.startswith(lock_path(target).name + ".stale-"):
            if fs.kind(path) == LINK and LockOwner.decode(fs.readlink(path)):
                fs.unlink(path)  # a stale lock moved aside, then the breaker was killed
            continue
        if not is_version_name(name, target.name):
            continue
        version = read_version(fs, target, name)
        if version is None:
            _remove_link_or_empty(fs, path, target)
            continue
        if published or not version.complete:
            discard(fs, path, scratch)
    remove_stray_beats(fs, parent, lock_path(target).name)
    if published:
        sweep_directory(fs, parent, skip=target.name, scratch=scratch)


def _remove_link_or_empty(fs: CheckpointStorage, path: Path, target: Path) -> None:
    """A link to one of ``target``'s versions (a killed publish or swap), or an empty
    directory (a killed probe, or a version made and killed before its plan)."""
    kind = fs.kind(path)
    if kind == LINK:
        points_to = fs.readlink(path)
        if is_version_name(points_to, target.name) or points_to.startswith(
            f".{target.name}.probe-"
        ):
            fs.unlink(path)
    elif kind == DIRECTORY and not fs.listdir(path):
        fs.rmdir(path)


def sweep_directory(
    fs: CheckpointStorage, parent: Path, *, skip: str | None = None, scratch: Path | None = None
) -> None:
    """Remove what killed saves and prunes left of checkpoints in ``parent`` that no longer
    exist (the path missing, or a link to nothing): their versions, links, probes and
    stale locks; each under that path's lock, taken only if its holder is gone."""
    orphans = set()
    for name in fs.listdir(parent):
        if not name.startswith(".") or name.startswith(TRASH_PREFIX):
            continue
        for marker in (_VERSION, ".link-", ".probe-", ".lock"):
            head, found, _ = name[1:].rpartition(marker)
            if found and head and head != skip:
                orphans.add(head)
    for name in sorted(orphans):
        target = parent / name
        kind = fs.kind(target)
        if kind == LINK and fs.kind(parent / fs.readlink(target)) != MISSING:
            continue
        if kind not in (MISSING, LINK):
            continue
        owner = LockOwner.here(f"sweep-{uuid.uuid4().hex[:8]}")
        try:
            acquire(fs, target, owner)
        except CheckpointBusyError:
            continue  # a save or prune of it is running (or its holder may be)
        try:
            if fs.kind(target) == LINK and fs.kind(parent / fs.readlink(target)) == MISSING:
                fs.unlink(target)  # a pruned link whose version is gone
            if fs.kind(target) == MISSING:
                remove_leftovers(fs, target, keep=None, published=False, scratch=scratch)
                for version in versions(fs, target):
                    discard(fs, parent / version.name, scratch)
        finally:
            release(fs, target, owner)


def sweep_in_place(
    fs: CheckpointStorage, target: Path, keep: Manifest | None, replaced: Manifest | None = None
) -> None:
    """In an in-place checkpoint, remove our data files that ``keep`` (the manifest now
    committed) does not list: those named with a save id, and those ``replaced`` (the
    previous manifest of ours at this path) lists; and a killed save's bookkeeping. Call
    only under the lock."""
    listed = set(keep.files) if keep is not None else set()
    earlier = set(replaced.files) if replaced is not None else set()
    for name in fs.listdir(target):
        if name in listed:
            continue
        ours = _IN_PLACE_FILE.match(name) or _DONE.match(name) or name in earlier
        bookkeeping = name in (PLAN_NAME, METADATA_TEMP, MANIFEST_TEMP)
        if (ours or bookkeeping) and fs.kind(target / name) == FILE:
            fs.unlink(target / name)


def remove_checkpoint(
    path, fs: CheckpointStorage | None = None, *, fence: Fence | None = None
) -> None:
    """Delete a checkpoint, crash-safely: a kill at any step leaves nothing that the next
    save or prune in the same directory does not remove.

    A directory (ours, or a stock checkpoint) is renamed to a trash name in one step, then
    deleted; a link is removed first (the checkpoint disappears whole), then its versions
    the same way. Works for every layout; ``shutil.rmtree`` does too on a directory.
    ``fence``: the owner generation it acts for; everything removed moves through its work
    directory, so a job that lost the directory removes nothing.
    """
    fs = posix_storage(fs)
    target = Path(path)
    scratch = None if fence is None else fence.work_dir
    owner = LockOwner.here(
        f"remove-{uuid.uuid4().hex[:8]}", generation=0 if fence is None else fence.generation
    )
    acquire(fs, target, owner)
    try:
        refuse_if_read(fs, target)  # a load holds it (CheckpointBusyError): prune it later
        kind = fs.kind(target)
        if kind == LINK:
            name = fs.readlink(target)
            if not is_version_name(name, target.name):
                raise CheckpointPathError(
                    f"{target}: is a link to {name!r}, not a checkpoint version; not removing it"
                )
            if scratch is not None:  # out through the work directory: fenced
                moved = scratch / f"{TRASH_PREFIX}{uuid.uuid4().hex}"
                fs.rename(target, moved)
                fs.unlink(moved)
            else:
                fs.unlink(target)
        elif kind == DIRECTORY:
            discard(fs, target, scratch)
        elif kind != MISSING:
            raise CheckpointPathError(f"{target}: is not a checkpoint directory; not removing it")
        remove_leftovers(fs, target, keep=None, published=True, scratch=scratch)
    finally:
        release(fs, target, owner)
