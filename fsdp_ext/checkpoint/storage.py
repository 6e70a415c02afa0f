"""The one protocol every checkpoint file operation goes through.

The writer, reader, manifest checks, locks, leases, directory ownership, resume and prune
never touch files themselves: they are handed a :class:`CheckpointStorage` and call its
operations. :class:`~fsdp_ext.checkpoint.fs.LocalStorage` is the local (POSIX) filesystem;
storage of another kind is one file, a subclass that implements the primitives:

=========================  ===============================================================
``open_read(path)``        a readable, seekable binary file
``open_write(path)``       a binary file created (or truncated) for writing
``kind(path)``             ``MISSING``, ``LINK``, ``DIRECTORY``, ``FILE`` or ``OTHER``, of
                           the path itself (a link is not followed)
``listdir(path)``          the names in a directory, sorted
``makedirs(path)``         a directory and its parents, where missing
``make_dir(path)``         a new directory; fails if anything is there
``rename(src, dst)``       atomic; replaces a file, a link or an empty directory at ``dst``
``exchange(a, b)``         swaps two paths atomically; ``OSError`` (``EINVAL``,
                           ``ENOTSUP``, ``EXDEV``...) where the storage cannot
``symlink(text, path)``    a link holding ``text``, made only if ``path`` is free
                           (``FileExistsError``): a lock is born with its record
``readlink(path)``         a link's text
``unlink(path)``           removes a file or a link
``rmdir(path)``            removes an empty directory
``remove_tree(path)``      removes a directory and all in it, one entry at a time
``fsync(path)``            makes a file's bytes, or a directory's entries, durable
=========================  ===============================================================

Leases need nothing more: a heartbeat is a link rewritten by ``symlink`` + ``rename``, judged
by the observer's own clock (``lock.py``), never by a modification time.

A missing path raises ``FileNotFoundError``. Four more have defaults a backend may
override: :meth:`~CheckpointStorage.open_directory` (read every file of a checkpoint from
the version that was there when it was opened; by default, by path),
:meth:`~CheckpointStorage.open_data_write` (a data file; by default ``open_write``),
:meth:`~CheckpointStorage.free_bytes` and :meth:`~CheckpointStorage.filesystem_id`.

It is also DCP's ``FileSystemBase`` (what a ``FileSystemWriter`` / ``FileSystemReader``
calls ``self.fs``): streams opened for writing keep the size and CRC-32 of what went
through them, so data files are hashed as they stream out. It holds no lock or open
handle, so a writer pickles into DCP's checkpoint process.
"""

from __future__ import annotations

import errno
import io
import os
import threading
from abc import abstractmethod
from collections.abc import Hashable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from torch.distributed.checkpoint.filesystem import FileSystemBase

from fsdp_ext.checkpoint.manifest import crc32, crc32_hex

__all__ = [
    "DIRECTORY",
    "FILE",
    "LINK",
    "MISSING",
    "OTHER",
    "SWAP_ENV",
    "CheckpointStorage",
    "StoredDirectory",
    "is_out_of_space",
    "unobserved",
]

# Set to 0 to keep the link layout even where directories can be swapped (tests, and
# filesystems that claim RENAME_EXCHANGE but are known to misbehave).
SWAP_ENV = "FSDP_EXT_CHECKPOINT_SWAP"

# What ``CheckpointStorage.kind`` answers.
MISSING, LINK, DIRECTORY, FILE, OTHER = "missing", "link", "directory", "file", "other"

# errno values by which a storage says it cannot exchange
_NO_EXCHANGE = {errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV}
# filesystem id -> whether exchange worked there; per process, probed once per filesystem
_EXCHANGE_BY_FILESYSTEM: dict[Hashable, bool] = {}


_UNOBSERVED = threading.local()


def unobserved() -> None:
    """From now on, this thread's storage operations skip :meth:`CheckpointStorage.before`:
    for a heartbeat thread, whose operations come at its own times, not at a save's."""
    _UNOBSERVED.on = True


def is_out_of_space(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)


class StoredDirectory:
    """A checkpoint directory opened for reading (:meth:`CheckpointStorage.open_directory`).

    This default reads by path: a save that swaps another version in meanwhile is not kept
    out. ``LocalStorage``'s holds the directory open and reads every file relative to it.
    """

    def __init__(self, storage: CheckpointStorage, path: Path):
        self.storage, self.path = storage, path

    def open_read(self, name: str) -> BinaryIO:
        return self.storage.open_read(self.path / name)

    def removed(self) -> bool:
        """Whether the directory was removed since it was opened (pruned, or replaced)."""
        return self.storage.kind(self.path) == MISSING

    def close(self) -> None:
        """Lets go of the directory (nothing to do when reading by path)."""


class _ChecksumStream:
    """A write-only file that keeps the CRC-32 and length of every byte written to it."""

    def __init__(self, raw: BinaryIO, storage: CheckpointStorage, path: str):
        self._raw = raw
        self._storage = storage
        self._path = path
        self.crc = 0
        self.size = 0

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        try:
            written = self._raw.write(view)
        except OSError as exc:
            # torch.save's zip writer turns this into "unexpected pos"; keep the real cause
            self._storage.write_errors.setdefault(self._path, exc)
            raise
        if self._storage.checksums:
            self.crc = crc32(view, self.crc)
        self.size += view.nbytes
        return written

    def tell(self) -> int:
        return self._raw.tell()

    def gap_before(self, data: memoryview, ahead: int) -> int:
        """Zero bytes the file wants before ``data`` (``DirectFile.gap_before``), else 0."""
        gap = getattr(self._raw, "gap_before", None)
        return 0 if gap is None else gap(data, ahead)

    def flush(self) -> None:
        self._raw.flush()

    def fileno(self) -> int:
        return self._raw.fileno()

    def writable(self) -> bool:
        return True

    def close(self) -> None:
        if self._raw.closed:
            return
        try:
            self._raw.close()
        except OSError as exc:  # the last buffered bytes did not fit
            self._storage.write_errors.setdefault(self._path, exc)
            raise
        self._storage.records[self._path] = (
            self.size,
            crc32_hex(self.crc) if self._storage.checksums else None,
        )

    @property
    def closed(self) -> bool:
        return self._raw.closed


class CheckpointStorage(FileSystemBase):
    """Where checkpoints live: the primitives above, and what the checkpoint code builds on
    them. Override :meth:`before` to observe or interrupt each step (a crash test stops a
    save at any single one). ``records`` maps every path written through
    :meth:`create_stream` to ``(size, crc32 or None)``; ``write_errors`` keeps the first
    ``OSError`` a stream hit, so a disk-full save can say so.
    """

    def __init__(self, checksums: bool = True, *, swap: bool | None = None) -> None:
        """``swap``: None probes the storage (see :meth:`can_exchange`); False keeps the
        link layout; True trusts that directories can be swapped."""
        if swap is not None and not isinstance(swap, bool):
            raise TypeError(f"swap must be None, True or False, got {swap!r}")
        self.checksums = checksums
        self.swap = swap
        self.records: dict[str, tuple[int, str | None]] = {}
        self.write_errors: dict[str, OSError] = {}

    def before(self, op: str, path: str | os.PathLike) -> None:
        """Called ahead of every operation of a save, load or prune (a no-op here): the
        seam for crash tests. Not for a heartbeat thread's, which come at its own times."""

    def observe(self, op: str, path: str | os.PathLike) -> None:
        """What a backend calls ahead of each primitive: :meth:`before`, unless this thread
        is :func:`unobserved`."""
        if not getattr(_UNOBSERVED, "on", False):
            self.before(op, path)

    # -- primitives: what a backend implements ----------------------------------------------

    @abstractmethod
    def open_read(self, path: str | os.PathLike) -> BinaryIO: ...

    @abstractmethod
    def open_write(self, path: str | os.PathLike) -> BinaryIO: ...

    @abstractmethod
    def kind(self, path: str | os.PathLike) -> str: ...

    @abstractmethod
    def listdir(self, path: str | os.PathLike) -> list[str]: ...

    @abstractmethod
    def makedirs(self, path: str | os.PathLike) -> None: ...

    @abstractmethod
    def make_dir(self, path: str | os.PathLike) -> None: ...

    @abstractmethod
    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None: ...

    @abstractmethod
    def exchange(self, a: str | os.PathLike, b: str | os.PathLike) -> None: ...

    @abstractmethod
    def symlink(self, target: str, path: str | os.PathLike) -> None: ...

    @abstractmethod
    def readlink(self, path: str | os.PathLike) -> str: ...

    @abstractmethod
    def unlink(self, path: str | os.PathLike) -> None: ...

    @abstractmethod
    def rmdir(self, path: str | os.PathLike) -> None: ...

    @abstractmethod
    def remove_tree(self, path: str | os.PathLike, missing_ok: bool = False) -> None:
        """With ``missing_ok``, entries another process removes meanwhile (two sweeps of
        one trash) are no error."""

    @abstractmethod
    def fsync(self, path: str | os.PathLike) -> None: ...

    # -- with defaults ----------------------------------------------------------------------

    def open_directory(self, path: str | os.PathLike) -> StoredDirectory:
        """The checkpoint directory at ``path``, or the version a link there points to,
        opened for reading; ``FileNotFoundError`` when there is none."""
        path = Path(path)
        root = path.parent / self.readlink(path) if self.kind(path) == LINK else path
        if self.kind(root) != DIRECTORY:
            raise FileNotFoundError(errno.ENOENT, "no such checkpoint directory", str(root))
        return StoredDirectory(self, root)

    def open_data_write(self, path: str | os.PathLike) -> BinaryIO:
        """A checkpoint data file, created for writing once, front to back (by default
        :meth:`open_write`; ``LocalStorage`` writes around the page cache where it can)."""
        return self.open_write(path)

    def free_bytes(self, path: str | os.PathLike) -> int:
        """Bytes free for new files at ``path`` (named in a disk-full error)."""
        raise OSError(errno.ENOTSUP, f"{type(self).__name__} cannot tell its free space")

    def filesystem_id(self, path: str | os.PathLike) -> Hashable | None:
        """Which filesystem holds ``path``: :meth:`can_exchange` probes once per id (None:
        at every save)."""
        return None

    # -- built on the primitives ------------------------------------------------------------

    def read_bytes(self, path: str | os.PathLike) -> bytes:
        with self.open_read(path) as stream:
            return stream.read()

    def write_file(self, path: str | os.PathLike, data: bytes, sync: bool) -> None:
        """Write a small file whole, fsynced when ``sync``; readers see it only once renamed."""
        with self.open_write(path) as stream:
            stream.write(data)
        if sync:
            self.fsync(path)

    def can_exchange(self, directory: str | os.PathLike, probe_name: str) -> bool:
        """Whether :meth:`exchange` works in ``directory``: tried once per filesystem, with a
        directory ``probe_name-a`` and a link ``probe_name-b`` (removed after; a killed probe
        leaves them to the sweep of ``versions.py``). Forced by ``swap`` or ``SWAP_ENV=0``."""
        if self.swap is not None:
            return self.swap
        if os.environ.get(SWAP_ENV, "").strip() == "0":
            return False
        key = self.filesystem_id(directory)
        if key is not None and key in _EXCHANGE_BY_FILESYSTEM:
            return _EXCHANGE_BY_FILESYSTEM[key]
        a, b = Path(directory) / f"{probe_name}-a", Path(directory) / f"{probe_name}-b"
        self.make_dir(a)
        try:
            self.symlink(a.name, b)
            try:
                self.exchange(a, b)
                works = self.kind(a) == LINK and self.kind(b) == DIRECTORY
            except OSError as exc:
                if exc.errno not in _NO_EXCHANGE:
                    raise
                works = False
        finally:
            for path in (a, b):
                kind = self.kind(path)
                if kind == LINK:
                    self.unlink(path)
                elif kind == DIRECTORY:
                    self.rmdir(path)
        if key is not None:
            _EXCHANGE_BY_FILESYSTEM[key] = works
        return works

    # -- DCP's FileSystemBase ---------------------------------------------------------------

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[io.IOBase]:
        if "w" not in mode:
            with self.open_read(path) as stream:
                yield stream
            return
        stream = _ChecksumStream(self.open_data_write(path), self, str(path))
        try:
            yield stream
        finally:
            stream.close()

    def concat_path(self, path: str | os.PathLike, suffix: str) -> Path:
        return Path(path) / suffix

    def init_path(self, path: str | os.PathLike) -> Path:
        return Path(path)

    def mkdir(self, path: str | os.PathLike) -> None:
        self.makedirs(path)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))

    def exists(self, path: str | os.PathLike) -> bool:
        return self.kind(path) != MISSING

    def rm_file(self, path: str | os.PathLike) -> None:
        self.unlink(path)
