"""The overwrite protocol: a checkpoint path is a link to a versioned directory beside it.

``step-100`` is a symbolic link to ``.step-100.v-<save id>``. A save writes a new version
directory, completes it (every rank's files, ``.metadata``, the manifest, all fsynced), and
publishes it by renaming a new link onto the path: rename(2) replaces the old link
atomically, so at every instant the path is the complete old checkpoint or the complete new
one (locally and over sshfs, whose posix-rename does the same on the server). The stock
``FileSystemReader(path)`` follows the link.

Cleanup deletes only what it can prove is its own: directories named ``.NAME.v-*`` whose
plan or manifest record names this target, and only while holding the path's lock (so no
other save of it is running). Before a publish, only unfinished versions go (a version
is published only once complete); after it, every version but the new one.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from pathlib import Path

from fsdp_ext.checkpoint.fs import DIRECTORY, FILE, LINK, MISSING, CheckpointFS
from fsdp_ext.checkpoint.lock import LockOwner, acquire, lock_path, refuse_if_read, release
from fsdp_ext.checkpoint.manifest import (
    MANIFEST_NAME,
    PLAN_NAME,
    CheckpointIntegrityError,
    CheckpointPathError,
    Manifest,
)

_VERSION = ".v-"


def version_name(target_name: str, save_id: str) -> str:
    return f".{target_name}{_VERSION}{save_id}"


def is_version_name(name: str, target_name: str) -> bool:
    prefix = f".{target_name}{_VERSION}"
    return name.startswith(prefix) and len(name) > len(prefix) and "/" not in name


def link_temp_name(target_name: str, save_id: str) -> str:
    return f".{target_name}.link-{save_id}"


@dataclass
class Version:
    """A version directory of a checkpoint path, described by its own records."""

    name: str
    save_id: str
    complete: bool  # has its manifest: every rank finished and .metadata was written
    replaces: str | None
    plan: dict | None  # the plan record of an unfinished save


def read_version(fs: CheckpointFS, target: Path, name: str) -> Version | None:
    """The version ``name`` beside ``target`` if its records say it is one; else None."""
    if not is_version_name(name, target.name):
        return None
    directory = target.parent / name
    if fs.kind(directory) != DIRECTORY:
        return None
    if fs.kind(directory / MANIFEST_NAME) == FILE:
        try:
            raw = fs.read_bytes(directory / MANIFEST_NAME).decode()
            manifest = Manifest.from_json(raw, str(directory / MANIFEST_NAME))
        except (CheckpointIntegrityError, UnicodeDecodeError):
            return None
        if manifest.target != target.name:
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


def versions(fs: CheckpointFS, target: Path) -> list[Version]:
    """Every version directory beside ``target`` that its records prove is one."""
    if fs.kind(target.parent) != DIRECTORY:
        return []
    found = (read_version(fs, target, name) for name in fs.listdir(target.parent))
    return [v for v in found if v is not None]


def current_version(fs: CheckpointFS, target: Path, *, overwrite: bool = True) -> str | None:
    """The version ``target`` points to, or None when there is no checkpoint to replace.

    Raises :class:`CheckpointPathError`, naming the path and what to do, when the path holds
    anything this writer did not make (a regular file, files in a directory, a link
    elsewhere), or anything at all under ``overwrite=False``; nothing is written before.
    """
    kind = fs.kind(target)
    if kind == MISSING:
        return None
    if kind == DIRECTORY and not fs.listdir(target):
        return None  # an empty directory: nothing to lose, replaced at publish
    if not overwrite:
        raise CheckpointPathError(
            f"{target}: already exists and overwrite=False; pass overwrite=True to replace it "
            "or choose another path"
        )
    if kind == LINK:
        name = fs.readlink(target)
        if is_version_name(name, target.name):
            return name
        raise CheckpointPathError(
            f"{target}: is a symbolic link to {name!r}, not to a version directory "
            f"SpreadFileSystemWriter made; it will not replace it. Remove the link or "
            "choose another path"
        )
    if kind == DIRECTORY:
        entries = fs.listdir(target)
        shown = ", ".join(entries[:3]) + (", ..." if len(entries) > 3 else "")
        raise CheckpointPathError(
            f"{target}: is a directory holding {len(entries)} entries ({shown}) that "
            "SpreadFileSystemWriter did not write (a checkpoint written in place by stock DCP "
            "or an earlier fsdp_ext, or other files); it never deletes what it did not write. "
            f"Move it away (mv {target} {target}.old) or choose another path"
        )
    raise CheckpointPathError(
        f"{target}: is a {'regular file' if kind == FILE else 'special file'}, not a "
        "checkpoint directory; it will not be replaced. Remove it or choose another path"
    )


def publish(fs: CheckpointFS, target: Path, version: str, save_id: str, sync: bool) -> None:
    """Point ``target`` at ``version`` with one atomic rename of a new link."""
    link = target.parent / link_temp_name(target.name, save_id)
    fs.symlink(version, link)
    if fs.kind(target) == DIRECTORY:
        fs.rmdir(target)  # empty (checked under the lock); rename cannot replace a directory
    fs.replace(link, target)
    if sync:
        fs.fsync(target.parent)


def remove_leftovers(fs: CheckpointFS, target: Path, *, keep: str | None, published: bool) -> None:
    """Remove what earlier saves of ``target`` left behind; call only under its lock.

    Before this save's publish (``published=False``) only unfinished versions go: a complete
    one might be what the path points to, if this node sees the link late (sshfs caches links
    for up to 20 s). After it, every version but ``keep``, which the path now points to.
    """
    parent = target.parent
    for name in fs.listdir(parent):
        if name == keep:
            continue
        if name.startswith(f".{target.name}.link-") and fs.kind(parent / name) == LINK:
            if is_version_name(fs.readlink(parent / name), target.name):
                fs.unlink(parent / name)  # a link a killed publish never renamed
            continue
        if name.startswith(lock_path(target).name + ".stale-"):
            if fs.kind(parent / name) == LINK and LockOwner.decode(fs.readlink(parent / name)):
                fs.unlink(parent / name)  # a stale lock moved aside, then the breaker was killed
            continue
        if not is_version_name(name, target.name):
            continue
        version = read_version(fs, target, name)
        if version is None:
            if fs.kind(parent / name) == DIRECTORY and not fs.listdir(parent / name):
                fs.rmdir(parent / name)  # made, then killed before its plan was written
            continue
        if published or not version.complete:
            fs.remove_tree(parent / name)


def remove_checkpoint(path, fs: CheckpointFS | None = None) -> None:
    """Delete a checkpoint: its link first (it disappears whole), then its versions.

    A plain directory (a stock checkpoint, or one written before versioned directories) is
    removed as it is. Use this instead of ``shutil.rmtree``, which refuses links.
    """
    fs = fs or CheckpointFS()
    target = Path(path)
    owner = LockOwner.here(f"remove-{uuid.uuid4()}")
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
            fs.unlink(target)
        elif kind == DIRECTORY:
            fs.remove_tree(target)
        elif kind != MISSING:
            raise CheckpointPathError(f"{target}: is not a checkpoint directory; not removing it")
        remove_leftovers(fs, target, keep=None, published=True)
    finally:
        release(fs, target, owner)
