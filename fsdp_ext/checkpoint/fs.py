"""The local (POSIX) filesystem as checkpoint storage: the one module that touches files.

Every operation calls :meth:`~fsdp_ext.checkpoint.storage.CheckpointStorage.before` with its
name first, so that a crash-consistency test can stop a save at any single step.

:meth:`LocalStorage.exchange` swaps two paths atomically (Linux ``renameat2`` with
``RENAME_EXCHANGE``: ext4, xfs, btrfs, tmpfs); whether a filesystem can is found out once per
filesystem (``st_dev``) by trying it, never from its name: sshfs and some NFS servers refuse
it, and there the checkpoint path stays a link (``versions.py``).

:meth:`LocalStorage.open_directory` opens the checkpoint's directory once and opens every
file relative to it, so a save that publishes over the path meanwhile cannot mix two
checkpoints into one load.

:meth:`LocalStorage.open_data_write` writes a data file around the page cache
(``direct_file.py``) on a filesystem that sits on a block device; elsewhere (tmpfs, FUSE
mounts such as sshfs, NFS, overlay) buffered, as ``open`` does.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import stat
from pathlib import Path
from typing import BinaryIO

from fsdp_ext.checkpoint.direct_file import open_direct
from fsdp_ext.checkpoint.storage import (
    DIRECTORY,
    FILE,
    LINK,
    MISSING,
    OTHER,
    CheckpointStorage,
    StoredDirectory,
)

__all__ = ["DIRECT_IO_ENV", "LocalStorage"]

# "0": data files always buffered; "1": O_DIRECT wherever the filesystem takes it (FUSE and
# network filesystems included); unset: on filesystems that sit on a block device
DIRECT_IO_ENV = "FSDP_EXT_DIRECT_IO"

_RENAME_EXCHANGE = 2
_AT_FDCWD = -100
_SYS_RENAMEAT2 = {"x86_64": 316, "aarch64": 276, "ppc64le": 357, "s390x": 347}


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


class _OpenedDirectory(StoredDirectory):
    """A directory held open by its file descriptor: files open relative to it, and a
    directory removed meanwhile is told by its link count (0)."""

    def __init__(self, storage: LocalStorage, path: Path, fd: int):
        super().__init__(storage, path)
        self._fd: int | None = fd

    def open_read(self, name: str) -> BinaryIO:
        fd = os.open(name, os.O_RDONLY, dir_fd=self._fd)
        return os.fdopen(fd, "rb", buffering=0)

    def removed(self) -> bool:
        return os.fstat(self._fd).st_nlink == 0

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class LocalStorage(CheckpointStorage):
    """Checkpoints on the local filesystem (or one mounted there: NFS, sshfs, Lustre).

    ``direct_io``: write data files around the page cache: None (default) where the
    filesystem sits on a block device and takes ``O_DIRECT`` (``$FSDP_EXT_DIRECT_IO``: ``0``
    never, ``1`` wherever it takes it); False never; True wherever it takes it."""

    def __init__(
        self, checksums: bool = True, *, swap: bool | None = None, direct_io: bool | None = None
    ) -> None:
        super().__init__(checksums, swap=swap)
        if direct_io is not None and not isinstance(direct_io, bool):
            raise TypeError(
                f"direct_io must be None (decide per filesystem), True or False, got {direct_io!r}"
            )
        self.direct_io = direct_io
        self._refused: set[int] = set()  # filesystems (st_dev) that refused O_DIRECT

    def _wants_direct(self, path: str | os.PathLike) -> int | None:
        """The filesystem id of ``path``'s directory where its data files go ``O_DIRECT``."""
        choice = self.direct_io
        if choice is None:
            env = os.environ.get(DIRECT_IO_ENV, "").strip()
            choice = {"0": False, "1": True}.get(env)
        if choice is False:
            return None
        device = os.stat(os.path.dirname(os.path.abspath(path))).st_dev
        if device in self._refused or (choice is None and os.major(device) == 0):
            return None  # major 0: no block device under it (tmpfs, FUSE, NFS, overlay)
        return device

    # -- reading ------------------------------------------------------------------------------

    def open_read(self, path: str | os.PathLike) -> BinaryIO:
        self.observe("read", path)
        return open(path, "rb", buffering=0)

    def open_directory(self, path: str | os.PathLike) -> StoredDirectory:
        path = Path(path)
        root = path.parent / os.readlink(path) if path.is_symlink() else path
        try:
            fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
        except NotADirectoryError as exc:
            raise FileNotFoundError(errno.ENOENT, "not a directory", str(root)) from exc
        return _OpenedDirectory(self, root, fd)

    def kind(self, path: str | os.PathLike) -> str:
        self.observe("lstat", path)
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
        self.observe("listdir", path)
        return sorted(os.listdir(path))

    def readlink(self, path: str | os.PathLike) -> str:
        self.observe("readlink", path)
        return os.readlink(path)

    def free_bytes(self, path: str | os.PathLike) -> int:
        self.observe("statvfs", path)
        st = os.statvfs(path)
        return st.f_bavail * st.f_frsize

    def filesystem_id(self, path: str | os.PathLike) -> int:
        self.observe("stat", path)
        return os.stat(path).st_dev

    # -- changes ------------------------------------------------------------------------------

    def open_write(self, path: str | os.PathLike) -> BinaryIO:
        self.observe("write", path)
        return open(path, "wb")

    def open_data_write(self, path: str | os.PathLike) -> BinaryIO:
        self.observe("write", path)
        device = self._wants_direct(path)
        if device is not None:
            stream = open_direct(path)
            if stream is not None:
                return stream
            self._refused.add(device)
        return open(path, "wb")

    def makedirs(self, path: str | os.PathLike) -> None:
        self.observe("makedirs", path)
        os.makedirs(path, exist_ok=True)

    def make_dir(self, path: str | os.PathLike) -> None:
        self.observe("mkdir", path)
        os.mkdir(path)

    def fsync(self, path: str | os.PathLike) -> None:
        self.observe("fsync", path)
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        self.observe("rename", new_path)
        os.replace(path, new_path)

    def exchange(self, a: str | os.PathLike, b: str | os.PathLike) -> None:
        self.observe("exchange", b)
        _renameat2_exchange(os.fspath(a), os.fspath(b))

    def symlink(self, target: str, path: str | os.PathLike) -> None:
        self.observe("symlink", path)
        os.symlink(target, path)

    def unlink(self, path: str | os.PathLike) -> None:
        self.observe("unlink", path)
        os.unlink(path)

    def rmdir(self, path: str | os.PathLike) -> None:
        self.observe("rmdir", path)
        os.rmdir(path)

    def remove_tree(self, path: str | os.PathLike, missing_ok: bool = False) -> None:
        """One ``unlink``/``rmdir`` at a time, so a crash test can stop it between any two,
        as a real kill can."""
        self.observe("remove_tree", path)
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
