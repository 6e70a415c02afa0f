"""Every filesystem operation of the checkpoint writer, in one small object.

Staging, writing, fsync, rename, publish and cleanup all go through :class:`CheckpointFS`, so
that a crash-consistency test can stop the writer at any single step (``before`` is called
with the operation's name ahead of each one) and another backend can replace the whole set.
It is also DCP's ``FileSystem`` for the data files: streams opened for writing keep the size
and CRC-32 of what went through them, so files are hashed as they stream out.

It holds no lock or open handle, so a writer pickles into DCP's checkpoint process
(``async_save(..., async_checkpointer_type=AsyncCheckpointerType.PROCESS)``).

:meth:`CheckpointFS.exchange` swaps two paths atomically (Linux ``renameat2`` with
``RENAME_EXCHANGE``: ext4, xfs, btrfs, tmpfs); whether a filesystem can is found out once per
filesystem by trying it (:meth:`CheckpointFS.can_exchange`), never from its name: sshfs and
some NFS servers refuse it, and there the checkpoint path stays a link (``versions.py``).
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import stat
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from torch.distributed.checkpoint.filesystem import FileSystem

from fsdp_ext.checkpoint.manifest import crc32_hex

__all__ = ["CheckpointFS", "is_out_of_space"]

# Set to 0 to keep the link layout even where directories can be swapped (tests, and
# filesystems that claim RENAME_EXCHANGE but are known to misbehave).
SWAP_ENV = "FSDP_EXT_CHECKPOINT_SWAP"

_RENAME_EXCHANGE = 2
_AT_FDCWD = -100
_SYS_RENAMEAT2 = {"x86_64": 316, "aarch64": 276, "ppc64le": 357, "s390x": 347}
# errno values by which a filesystem or kernel says it cannot exchange
_NO_EXCHANGE = {errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV}
# st_dev -> whether RENAME_EXCHANGE worked there; per process, probed once per filesystem
_EXCHANGE_BY_DEVICE: dict[int, bool] = {}


def _renameat2_exchange(a: str, b: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if hasattr(libc, "renameat2"):  # glibc >= 2.28
        rc = libc.renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    else:
        number = _SYS_RENAMEAT2.get(platform.machine())
        if number is None:
            raise OSError(errno.ENOSYS, "renameat2 is not known on this machine", a)
        rc = libc.syscall(
            number, _AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE
        )
    if rc != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"renameat2(RENAME_EXCHANGE): {os.strerror(code)}", a, None, b)


# What ``CheckpointFS.kind`` answers.
MISSING, LINK, DIRECTORY, FILE, OTHER = "missing", "link", "directory", "file", "other"


def is_out_of_space(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)


class _ChecksumStream:
    """A write-only file that keeps the CRC-32 and length of every byte written to it."""

    def __init__(self, raw, fs: CheckpointFS, path: str):
        self._raw = raw
        self._fs = fs
        self._path = path
        self.crc = 0
        self.size = 0

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        try:
            written = self._raw.write(view)
        except OSError as exc:
            # torch.save's zip writer turns this into "unexpected pos"; keep the real cause
            self._fs.write_errors.setdefault(self._path, exc)
            raise
        if self._fs.checksums:
            self.crc = zlib.crc32(view, self.crc)
        self.size += view.nbytes
        return written

    def tell(self) -> int:
        return self._raw.tell()

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
            self._fs.write_errors.setdefault(self._path, exc)
            raise
        self._fs.records[self._path] = (
            self.size,
            crc32_hex(self.crc) if self._fs.checksums else None,
        )

    @property
    def closed(self) -> bool:
        return self._raw.closed


class CheckpointFS(FileSystem):
    """Local (POSIX) filesystem operations of a checkpoint save.

    Override :meth:`before` to observe or interrupt each step; subclass and override the
    operations to put checkpoints elsewhere. ``records`` maps every path written through
    :meth:`create_stream` to ``(size, crc32 or None)``; ``write_errors`` keeps the first
    ``OSError`` a stream hit, so a disk-full save can say so.
    """

    def __init__(self, checksums: bool = True, *, swap: bool | None = None) -> None:
        """``swap``: None probes the filesystem (see :meth:`can_exchange`); False keeps the
        link layout; True trusts that directories can be swapped."""
        if swap is not None and not isinstance(swap, bool):
            raise TypeError(f"swap must be None, True or False, got {swap!r}")
        self.checksums = checksums
        self.swap = swap
        self.records: dict[str, tuple[int, str | None]] = {}
        self.write_errors: dict[str, OSError] = {}

    def before(self, op: str, path: str | os.PathLike) -> None:
        """Called ahead of every operation (a no-op here): the seam for crash tests."""

    # -- DCP's FileSystem: data files -------------------------------------------------------

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator:
        if "w" not in mode:
            self.before("open_read", path)
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        self.before("write", path)
        stream = _ChecksumStream(open(path, mode), self, str(path))  # noqa: SIM115 (closed below)
        try:
            yield stream
        finally:
            stream.close()

    # -- inspection ---------------------------------------------------------------------------

    def kind(self, path: str | os.PathLike) -> str:
        """What is at ``path`` itself (a link is not followed)."""
        self.before("lstat", path)
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            return MISSING
        if stat.S_ISLNK(mode):
            return LINK
        if stat.S_ISDIR(mode):
            return DIRECTORY
        return FILE if stat.S_ISREG(mode) else OTHER

    def listdir(self, path: str | os.PathLike) -> list[str]:
        self.before("listdir", path)
        return sorted(os.listdir(path))

    def readlink(self, path: str | os.PathLike) -> str:
        self.before("readlink", path)
        return os.readlink(path)

    def read_bytes(self, path: str | os.PathLike) -> bytes:
        self.before("read", path)
        return Path(path).read_bytes()

    def free_bytes(self, path: str | os.PathLike) -> int:
        self.before("statvfs", path)
        st = os.statvfs(path)
        return st.f_bavail * st.f_frsize

    # -- changes ------------------------------------------------------------------------------

    def makedirs(self, path: str | os.PathLike) -> None:
        """Create ``path`` and its parents if missing (the checkpoint's parent directory)."""
        self.before("makedirs", path)
        os.makedirs(path, exist_ok=True)

    def make_dir(self, path: str | os.PathLike) -> None:
        """Create a new directory; fails if anything is there."""
        self.before("mkdir", path)
        os.mkdir(path)

    def write_file(self, path: str | os.PathLike, data: bytes, sync: bool) -> None:
        """Write a small file whole, fsynced when ``sync``; readers see it only once renamed."""
        self.before("write", path)
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            if sync:
                self.before("fsync", path)
                os.fsync(f.fileno())

    def fsync(self, path: str | os.PathLike) -> None:
        """fsync a file or a directory by path (a directory, so renames in it persist)."""
        self.before("fsync", path)
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def replace(self, src: str | os.PathLike, dst: str | os.PathLike) -> None:
        """rename(2): atomic, and replaces ``dst`` when it is a file or a link."""
        self.before("rename", dst)
        os.replace(src, dst)

    def exchange(self, a: str | os.PathLike, b: str | os.PathLike) -> None:
        """Swap ``a`` and ``b`` in one atomic step (both must exist; any kinds)."""
        self.before("exchange", b)
        _renameat2_exchange(os.fspath(a), os.fspath(b))

    def can_exchange(self, directory: str | os.PathLike, probe_name: str) -> bool:
        """Whether :meth:`exchange` works in ``directory``: tried once per filesystem, with a
        directory ``probe_name-a`` and a link ``probe_name-b`` (removed after; a killed probe
        leaves them to the sweep of ``versions.py``). Forced by ``swap`` or ``SWAP_ENV=0``."""
        if self.swap is not None:
            return self.swap
        if os.environ.get(SWAP_ENV, "").strip() == "0":
            return False
        self.before("stat", directory)
        device = os.stat(directory).st_dev
        if device in _EXCHANGE_BY_DEVICE:
            return _EXCHANGE_BY_DEVICE[device]
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
        _EXCHANGE_BY_DEVICE[device] = works
        return works

    def symlink(self, target: str, path: str | os.PathLike) -> None:
        """Create a symbolic link; fails with ``FileExistsError`` if ``path`` exists."""
        self.before("symlink", path)
        os.symlink(target, path)

    def unlink(self, path: str | os.PathLike) -> None:
        self.before("unlink", path)
        os.unlink(path)

    def rmdir(self, path: str | os.PathLike) -> None:
        """Remove an empty directory (fails on anything else, so it never loses data)."""
        self.before("rmdir", path)
        os.rmdir(path)

    def remove_tree(self, path: str | os.PathLike, missing_ok: bool = False) -> None:
        """Remove a directory and everything in it, one ``unlink``/``rmdir`` at a time (so a
        crash test can stop it between any two, as a real kill can); with ``missing_ok``,
        entries another process removes meanwhile (two sweeps of one trash) are no error."""
        self.before("remove_tree", path)
        try:
            walk = list(os.walk(path, topdown=False))
        except FileNotFoundError:
            if missing_ok:
                return
            raise
        if not walk and not missing_ok:
            raise FileNotFoundError(errno.ENOENT, "no such directory", str(path))
        for directory, dirs, files in walk:
            for name in files + [d for d in dirs if os.path.islink(os.path.join(directory, d))]:
                self._remove(self.unlink, os.path.join(directory, name), missing_ok)
            self._remove(self.rmdir, directory, missing_ok)

    @staticmethod
    def _remove(remove, path: str, missing_ok: bool) -> None:
        try:
            remove(path)
        except FileNotFoundError:
            if not missing_ok:
                raise
