"""The blob primitives on a POSIX directory (local disk, NFS, sshfs, Lustre).

A key ``a/b/c`` is the file ``ROOT/a/b/c``. How each primitive keeps its promise:

- ``put``: the bytes go to a temporary file beside the target (``.blob-tmp-*``), fsynced,
  then ``rename``\\ d over it (atomic), and the directory is fsynced;
- ``put_if_absent``: the same temporary file, then ``link(2)`` to the key, which fails with
  ``EEXIST`` when anything is there: the object is born whole, and only one creator wins
  (``link`` is atomic on local filesystems, NFS and sshfs alike; ``O_EXCL`` was not on old
  NFS clients);
- ``replace_if``, ``put`` and ``delete`` take the key's lock, ``.blob-lock-NAME`` beside it,
  itself made by ``link`` (so one holder at a time), for the few operations between reading
  the current ETag and the rename: without it a plain ``put`` landing between a
  ``replace_if``'s compare and its rename would be lost, which S3 never does.
  ``put_if_absent`` needs no lock: while a locked writer works the object exists, so the
  link fails, as it should;
- the ETag is the MD5 of the bytes in quotes (S3's for a single-part upload), read from the
  file: a stale one fails whenever the bytes changed, whatever the inode numbers, timestamps
  or clocks, which is why neither ``mtime`` nor ``st_ino`` is used (an inode is reused at
  once on ext4, and an mtime tick is a few milliseconds). The price: ``head`` reads the
  object (fine for the small records conditional writes are for);
- ``get`` seeks and reads; ``list`` walks the directory under the prefix; ``delete`` unlinks,
  then removes the directories it emptied (a ``put`` racing it retries once).

A lock whose holder died on this machine (its pid no longer runs with the recorded start
time) is broken at once; one held from another machine is waited for for ``lock_wait_s``,
then :class:`BlobLockedError` names it, its holder and how to remove it. A killed writer can
leave a ``.blob-tmp-*`` file, which ``list`` never shows.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import socket
import time
import uuid
from typing import Any

from fsdp_ext.checkpoint.blob import (
    INTERNAL_PREFIX,
    BlobChangedError,
    BlobError,
    BlobExistsError,
    BlobInfo,
    BlobNotFoundError,
    BlobStore,
    Data,
    check_data,
    check_key,
    check_prefix,
    check_range,
    etag_of,
    is_stream,
)
from fsdp_ext.checkpoint.processes import boot_id, process_start

__all__ = ["BlobLockedError", "PosixBlobStore"]

_TMP = INTERNAL_PREFIX + "tmp-"
_LOCK = INTERNAL_PREFIX + "lock-"
_CHUNK = 1 << 20


class BlobLockedError(BlobError):
    """A key's lock stayed held, by a process on another machine, for ``lock_wait_s``."""


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _md5_file(path: str) -> tuple[int, str]:
    """The size and ETag of the file at ``path`` (FileNotFoundError when there is none)."""
    digest = hashlib.md5(usedforsecurity=False)
    size = 0
    with open(path, "rb", buffering=0) as stream:
        while chunk := stream.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return size, f'"{digest.hexdigest()}"'


def _holder_record() -> bytes:
    pid = os.getpid()
    return json.dumps(
        {
            "host": socket.gethostname(),
            "boot_id": boot_id(),
            "pid": pid,
            "start": process_start(pid),
        }
    ).encode()


def _holder_dead(record: bytes) -> bool:
    """Whether a lock's holder provably died: it ran on this machine (host and boot id) and
    its pid no longer runs with the recorded start time."""
    try:
        holder = json.loads(record)
    except ValueError:
        return False
    if holder.get("host") != socket.gethostname() or holder.get("boot_id") != boot_id():
        return False
    return process_start(int(holder.get("pid", -1))) != holder.get("start")


class PosixBlobStore(BlobStore):
    """Blobs as files under ``root`` (see the module docstring). ``location``: the name the
    user gave (kept for messages); ``lock_wait_s``: how long to wait for a key's lock."""

    def __init__(self, root: str, *, location: str | None = None, lock_wait_s: float = 30.0):
        if not isinstance(root, str) or not os.path.isabs(root):
            raise ValueError(f"root must be an absolute path, got {root!r}")
        self.root = os.path.normpath(root)
        self.location = location if location is not None else self.root
        self.lock_wait_s = lock_wait_s

    # -- paths --------------------------------------------------------------------------------

    def _path(self, key: str) -> str:
        return os.path.join(self.root, *check_key(key).split("/"))

    def _temp_with(self, path: str, data: Any, sync: bool = True, digest: Any = None) -> str:
        """A temporary file beside ``path`` holding ``data`` (a memoryview, or a stream of
        chunks written one at a time), fsynced when ``sync`` (directories made); each chunk
        also goes to ``digest.update`` when one is given."""
        parent = os.path.dirname(path)
        temp = os.path.join(parent, f"{_TMP}{uuid.uuid4().hex}")
        for attempt in range(2):  # a delete may remove the emptied parent in between
            try:
                os.makedirs(parent, exist_ok=True)
                fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                break
            except FileNotFoundError:
                if attempt:
                    raise
            except (NotADirectoryError, FileExistsError) as exc:  # a part is a file
                raise self._prefix_clash(os.path.relpath(path, self.root)) from exc
        try:
            with os.fdopen(fd, "wb") as stream:
                for chunk in data if is_stream(data) else (data,):
                    stream.write(chunk)
                    if digest is not None:
                        digest.update(chunk)
                stream.flush()
                if sync:
                    os.fsync(stream.fileno())
        except BaseException:
            self._discard(temp)
            raise
        return temp

    @staticmethod
    def _discard(path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)

    # -- the key's lock -----------------------------------------------------------------------

    def _lock(self, path: str) -> str:
        """Take ``path``'s lock (a link made once by one holder); returns the lock's path."""
        parent, name = os.path.split(path)
        lock = os.path.join(parent, f"{_LOCK}{name}")
        record = _holder_record()
        mine = self._temp_with(lock, memoryview(record), sync=False)
        try:
            deadline = time.monotonic() + self.lock_wait_s
            pause = 0.001
            while True:
                try:
                    os.link(mine, lock)
                    return lock
                except FileExistsError:
                    pass
                held = self._read_lock(lock)
                if held is not None and _holder_dead(held):
                    self._break(lock, held)
                    continue
                if time.monotonic() > deadline:
                    holder = held.decode(errors="replace") if held else "unknown"
                    raise BlobLockedError(
                        f"{self.location}: the lock {lock} of {path} has been held for over "
                        f"{self.lock_wait_s:g} s by {holder}; if that process is gone, remove "
                        "the lock file"
                    )
                time.sleep(pause)
                pause = min(pause * 2, 0.05)
        finally:
            self._discard(mine)

    @staticmethod
    def _read_lock(lock: str) -> bytes | None:
        try:
            with open(lock, "rb") as stream:
                return stream.read()
        except FileNotFoundError:
            return None

    def _break(self, lock: str, held: bytes) -> None:
        """Remove a dead holder's lock: moved aside first (one breaker wins), then checked to
        be that holder's; a live lock taken meanwhile is put back."""
        grave = f"{lock}.{uuid.uuid4().hex}"
        try:
            os.rename(lock, grave)
        except FileNotFoundError:
            return  # released or broken by another
        if self._read_lock(grave) != held:
            with contextlib.suppress(FileExistsError):
                os.link(grave, lock)
        self._discard(grave)

    def _unlock(self, lock: str) -> None:
        self._discard(lock)

    # -- the primitives -----------------------------------------------------------------------

    def put(self, key: str, data: Data) -> str:
        path = self._path(key)
        digest = hashlib.md5(usedforsecurity=False)
        temp = self._temp_with(path, data if is_stream(data) else check_data(data), digest=digest)
        lock = self._lock(path)
        try:
            self._rename(temp, path)
        finally:
            self._unlock(lock)
        return f'"{digest.hexdigest()}"'

    def put_if_absent(self, key: str, data: bytes | bytearray | memoryview) -> str:
        path, view = self._path(key), check_data(data)
        temp = self._temp_with(path, view)
        try:
            os.link(temp, path)
        except FileExistsError:
            raise BlobExistsError(
                f"{self.where(key)}: already exists (put_if_absent: another writer created it)"
            ) from None
        except IsADirectoryError as exc:
            raise self._prefix_clash(key) from exc
        finally:
            self._discard(temp)
        _fsync_dir(os.path.dirname(path))
        return etag_of(view)

    def replace_if(self, key: str, data: bytes | bytearray | memoryview, etag: str) -> str:
        if not isinstance(etag, str) or not etag:
            raise ValueError(f"etag must be a non-empty str (from put or head), got {etag!r}")
        path, view = self._path(key), check_data(data)
        temp = self._temp_with(path, view)
        try:
            lock = self._lock(path)
            try:
                try:
                    _, current = _md5_file(path)
                except FileNotFoundError:
                    raise BlobChangedError(
                        f"{self.where(key)}: replace_if found no object (it was deleted)"
                    ) from None
                if current != etag:
                    raise BlobChangedError(
                        f"{self.where(key)}: replace_if expected ETag {etag}, found {current} "
                        "(another writer changed it)"
                    )
                self._rename(temp, path)
            finally:
                self._unlock(lock)
        finally:
            self._discard(temp)
        return etag_of(view)

    def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        first, end = check_range(start, end)
        path = self._path(key)
        try:
            with open(path, "rb", buffering=0) as stream:
                stream.seek(first)
                if end is None:
                    return stream.read()
                wanted, parts = end - first, []
                while wanted > 0 and (part := stream.read(wanted)):
                    parts.append(part)
                    wanted -= len(part)
                return b"".join(parts)
        except FileNotFoundError:
            raise BlobNotFoundError(f"{self.where(key)}: no such object") from None
        except IsADirectoryError:
            raise BlobNotFoundError(f"{self.where(key)}: no such object (a prefix)") from None

    def head(self, key: str) -> BlobInfo | None:
        path = self._path(key)
        try:
            return BlobInfo(*_md5_file(path))
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            return None

    def list(self, prefix: str = "") -> list[str]:
        prefix = check_prefix(prefix)
        base = os.path.join(self.root, *prefix.split("/")[:-1]) if "/" in prefix else self.root
        found = []
        for directory, dirs, files in os.walk(base):
            dirs[:] = [d for d in dirs if not d.startswith(INTERNAL_PREFIX)]
            rel = os.path.relpath(directory, self.root)
            for name in files:
                if name.startswith(INTERNAL_PREFIX):
                    continue
                key = name if rel == "." else f"{rel.replace(os.sep, '/')}/{name}"
                if key.startswith(prefix):
                    found.append(key)
        return sorted(found)

    def delete(self, key: str) -> None:
        path = self._path(key)
        if not os.path.isdir(os.path.dirname(path)):
            return
        lock = self._lock(path)
        try:
            try:
                os.unlink(path)
            except (FileNotFoundError, IsADirectoryError):
                return
        finally:
            self._unlock(lock)
        _fsync_dir(os.path.dirname(path))
        self._remove_empty_parents(os.path.dirname(path))

    # -- helpers ------------------------------------------------------------------------------

    def _rename(self, temp: str, path: str) -> None:
        try:
            os.replace(temp, path)
        except IsADirectoryError as exc:
            raise self._prefix_clash(os.path.relpath(path, self.root)) from exc
        _fsync_dir(os.path.dirname(path))

    def _prefix_clash(self, key: str) -> BlobError:
        return BlobError(
            f"{self.where(key)}: other keys continue it with '/', and on a POSIX store a key "
            "cannot be both an object and a prefix followed by '/'"
        )

    def _remove_empty_parents(self, directory: str) -> None:
        while directory != self.root and directory.startswith(self.root + os.sep):
            try:
                os.rmdir(directory)
            except OSError as exc:
                if exc.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOENT, errno.EBUSY):
                    return
                raise
            directory = os.path.dirname(directory)
