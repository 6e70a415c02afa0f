"""A FileSystemReader that verifies every file it reads and never runs a stored pickle.

Stock DCP loading trusts the files: a flipped byte in a ``.distcp`` file loads silently,
``read_metadata`` calls ``pickle.load`` and ``DefaultLoadPlanner.load_bytes`` calls
``torch.load(weights_only=False)``. Here:

- ``.metadata`` is checked against the manifest, then read by a restricted unpickler;
- every rank checks the size of each data file it opens, and each file's CRC-32 is checked
  once, by one of the ranks that read it (``verify_plan.py``: hashing divided, not repeated
  by every reader; a rank prefers its own files). A failed check fails the load on every
  rank;
- the files a rank reads (nearly) whole are read ahead, whole, on a few threads within a
  byte budget (:class:`_ReadAhead`), hashed there, and DCP's reads are served from memory:
  on network storage each file's open is a round trip and per-layer files make many, which
  left the link idle between files (a 4-rank FSDP load over sshfs took 1.31x stock's);
- non-tensor items are opened with ``weights_only=True``. Pass ``planner=SafeLoadPlanner()``
  to ``dcp.load``; with any other planner this reader still vets each item the same way
  before handing it on.

A checkpoint without a manifest (written by the stock writer) loads with one warning that
it was not verified; one whose metadata says it was written with a manifest but has none
is refused.
"""

from __future__ import annotations

import dataclasses
import io
import os
import warnings
import zlib
from collections import deque
from concurrent.futures import Future as PoolFuture
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from fsdp_ext._torch import pass_metadata_error_to_dcp_load, set_state_dict_element
from fsdp_ext.checkpoint.manifest import (
    MANIFEST_NAME,
    MARKER,
    METADATA_NAME,
    NO_CHECKSUM,
    CheckpointIntegrityError,
    Manifest,
    check_record,
    checksum_bytes,
    crc32_hex,
    read_manifest,
)
from fsdp_ext.checkpoint.unpickler import load_metadata, load_object_safely
from fsdp_ext.checkpoint.verify_plan import assign_checks


class SafeLoadPlanner(DefaultLoadPlanner):
    """A ``DefaultLoadPlanner`` whose non-tensor items load with ``weights_only=True``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        obj = load_object_safely(value.getvalue(), f"item {read_item.dest_index.fqn}")
        if self.flatten_state_dict:
            path = self.mappings[read_item.dest_index.fqn]
            set_state_dict_element(self.original_state_dict, path, obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


# Read-ahead: files of at most this size are read whole ahead of DCP (bigger ones are
# streamed: their open costs little against their bytes), on this many threads, holding at
# most this many bytes that DCP has not consumed yet.
READ_AHEAD_FILE_BYTES = 256 << 20
READ_AHEAD_THREADS = 4
READ_AHEAD_BUDGET = 512 << 20


def _read_whole(path: Path, checksums: bool) -> tuple[bytes, str | None]:
    """A file's bytes and, when asked, their CRC-32 (zlib and file reads release the GIL)."""
    with open(path, "rb") as stream:
        data = stream.read()
    return data, crc32_hex(zlib.crc32(data)) if checksums else None


class _ReadAhead:
    """Reads files whole, in the order DCP will ask for them, a few at a time and within a
    byte budget; :meth:`take` hands one over (waiting for it) and frees its budget."""

    def __init__(self, jobs: list[tuple[Path, int, bool]]):
        self._pending = deque(jobs)
        self._started: dict[Path, tuple[PoolFuture, int]] = {}
        self._held = 0
        self._pool = ThreadPoolExecutor(READ_AHEAD_THREADS, thread_name_prefix="ckpt-read")
        self._start_more()

    def _start_more(self) -> None:
        while self._pending and (
            not self._started or self._held + self._pending[0][1] <= READ_AHEAD_BUDGET
        ):
            path, size, checksums = self._pending.popleft()
            self._started[path] = (self._pool.submit(_read_whole, path, checksums), size)
            self._held += size

    def take(self, path: Path) -> tuple[bytes, str | None] | None:
        """The file's (bytes, CRC-32 or None); None when it is not read ahead."""
        if path not in self._started:
            return None
        future, size = self._started.pop(path)
        try:
            return future.result()
        finally:
            self._held -= size
            self._start_more()

    def close(self) -> None:
        self._pending.clear()
        self._pool.shutdown(wait=True, cancel_futures=True)


class _VerifiedFileSystem(FileSystem):
    """Opens each data file after checking it: its size always; its CRC-32 too when this
    rank is the one that checks it. A file read ahead is checked and served from memory;
    any other is hashed in a pass over the open file, then DCP reads it through the same
    open file."""

    def __init__(self, reader: VerifiedFileSystemReader):
        self.reader = reader

    @contextmanager
    def create_stream(self, path, mode: str):
        reader, path = self.reader, self.reader.resolve(path)
        if "r" not in mode or reader.manifest is None:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        record = reader.manifest.files[path.name]
        try:
            fetched = reader.read_ahead.take(path) if reader.read_ahead else None
            stream = open(path, "rb") if fetched is None else None  # noqa: SIM115 (closed below)
        except FileNotFoundError as exc:
            raise CheckpointIntegrityError(
                f"{path}: missing ({record.size} bytes expected)"
            ) from exc
        if fetched is not None:
            data, checksum = fetched
            check_record(str(path), record, len(data), checksum)
            yield io.BytesIO(data)
            return
        with stream:
            if path.name in reader.checks_here:
                size, checksum = reader.checksum_open_file(stream)
                check_record(str(path), record, size, checksum)
                stream.seek(0)
            else:
                check_record(str(path), record, os.fstat(stream.fileno()).st_size, None)
            yield stream


class VerifiedFileSystemReader(FileSystemReader):
    """Checks size and checksum of every file it reads; unpickles nothing it need not.

    ``dcp.load(state, storage_reader=VerifiedFileSystemReader(path),
    planner=SafeLoadPlanner())``. Errors: :class:`CheckpointIntegrityError` (missing,
    truncated or altered file, named with expected and found values) and
    :class:`UnsafeCheckpointError` (a pickle that would run code, or metadata that is not
    what DCP writes). A checkpoint saved with ``checksums=False`` is refused unless
    ``require_checksums=False`` (then sizes alone are checked, with a warning).

    A path that is a link to a version directory (what ``SpreadFileSystemWriter`` publishes)
    is resolved once, and every file is read from that version, so a save publishing over
    the path meanwhile cannot mix two checkpoints; the ranks check that they all resolved
    the same version (a node of a network filesystem may see a new link late).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        _extension_registry=None,  # stock's (experimental) stream extensions, passed on
        *,
        require_checksums: bool = True,
    ) -> None:
        if not isinstance(require_checksums, bool):
            raise TypeError(f"require_checksums must be a bool, got {require_checksums!r}")
        super().__init__(path, _extension_registry)
        self.fs = _VerifiedFileSystem(self)
        self.require_checksums = require_checksums
        self.manifest: Manifest | None = None
        self._manifest_loaded = False
        self._root: Path | None = None
        self.checks_here: set[str] = set()  # files whose checksum this rank checks
        self.read_ahead: _ReadAhead | None = None  # during read_data
        self._block = bytearray(4 << 20)  # reused for checksums: no allocation per file

    def reset(self, checkpoint_id=None) -> None:
        super().reset(checkpoint_id)
        self.manifest, self._manifest_loaded, self._root = None, False, None
        self.checks_here = set()

    @property
    def root(self) -> Path:
        """The directory files are read from: the version the path linked to when resolved."""
        if self._root is None:
            path = Path(self.path)
            self._root = path.parent / os.readlink(path) if path.is_symlink() else path
        return self._root

    def resolve(self, path) -> Path:
        """A file under the checkpoint path, read from the resolved version directory."""
        return self.root / Path(path).name

    def _load_manifest(self) -> Manifest | None:
        if not self._manifest_loaded:
            directory = self.root
            if not directory.is_dir():
                raise CheckpointIntegrityError(f"{self.path}: no such checkpoint directory")
            self.manifest = read_manifest(directory)
            self._manifest_loaded = True
        return self.manifest

    def read_metadata(self) -> Metadata:
        # No **kwargs on purpose: dcp.load then does not retry with per-rank metadata files
        # (a format we do not write) and repeat the error.
        try:
            return self._read_verified_metadata()
        except (CheckpointIntegrityError, UnsafeCheckpointError) as exc:
            pass_metadata_error_to_dcp_load(exc)  # torch 2.11 would swallow it
            raise

    def _read_verified_metadata(self) -> Metadata:
        manifest = self._load_manifest()
        path = self.root / METADATA_NAME
        if not path.is_file():
            raise CheckpointIntegrityError(
                f"{path}: missing (the save did not finish, or the file was deleted)"
            )
        data = path.read_bytes()
        if manifest is not None and manifest.checksum == NO_CHECKSUM:
            if self.require_checksums:
                raise CheckpointIntegrityError(
                    f"{self.root / MANIFEST_NAME}: records no checksums (saved with "
                    "checksums=False, or the field was altered), so a changed byte could not "
                    "be detected; pass require_checksums=False to load it on sizes alone"
                )
            warnings.warn(
                f"{self.path}: written with checksums=False; verifying file sizes only",
                stacklevel=2,
            )
        if manifest is not None:
            check_record(str(path), manifest.metadata, len(data), self._checksum(data))
        metadata = load_metadata(data, str(path))
        modules = getattr(metadata.storage_meta, "modules", None) or []
        if manifest is None:
            if MARKER in modules:
                raise CheckpointIntegrityError(
                    f"{self.root / MANIFEST_NAME}: missing, but {path} says the "
                    "checkpoint was written with one; its files cannot be verified"
                )
            warnings.warn(
                f"{self.path}: no {MANIFEST_NAME} (not written by SpreadFileSystemWriter); "
                "loading without size and checksum verification",
                stacklevel=2,
            )
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args, **kwargs):
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        manifest = self._load_manifest()
        if manifest is None:
            return
        for info in self.storage_data.values():
            if info.relative_path not in manifest.files:
                raise CheckpointIntegrityError(
                    f"{self.root / info.relative_path}: referenced by {METADATA_NAME} "
                    f"but not listed in {MANIFEST_NAME}"
                )

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        reads: dict[str, int] = {}
        for item in plan.items:
            info = self.storage_data[item.storage_index]
            reads[info.relative_path] = reads.get(info.relative_path, 0) + info.length
        return dataclasses.replace(plan, storage_data=(self.root.name, reads))

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        seen: dict[str, list[int]] = {}
        for rank, plan in enumerate(plans):
            seen.setdefault(plan.storage_data[0], []).append(rank)
        if len(seen) > 1:
            views = "; ".join(f"ranks {ranks} read {name}" for name, ranks in seen.items())
            raise CheckpointIntegrityError(
                f"{self.path}: the ranks resolved it to different versions ({views}): a save "
                "published over it during the load, or a node of a network filesystem still "
                "sees the previous link (sshfs keeps links up to 20 s); load again"
            )
        manifest = self._load_manifest()
        if manifest is None:
            return [dataclasses.replace(p, storage_data=set()) for p in plans]
        checks = assign_checks(
            [p.storage_data[1] for p in plans],
            {name: rec.size for name, rec in manifest.files.items()},
            {name: rec.rank for name, rec in manifest.files.items()},
        )
        return [dataclasses.replace(p, storage_data=c) for p, c in zip(plans, checks, strict=True)]

    def checksum_open_file(self, stream) -> tuple[int, str | None]:
        """Size and CRC-32 of an open file, read through a small reused block."""
        if self.manifest.checksum == NO_CHECKSUM:
            return os.fstat(stream.fileno()).st_size, None
        view = memoryview(self._block)
        crc, size = 0, 0
        while n := stream.readinto(view):
            crc = zlib.crc32(view[:n], crc)
            size += n
        return size, crc32_hex(crc)

    def _checksum(self, data: bytes) -> str | None:
        return None if self.manifest.checksum == NO_CHECKSUM else checksum_bytes(data)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        self.checks_here = set(plan.storage_data or ())
        self.read_ahead = self._plan_read_ahead(plan)
        try:
            return super().read_data(plan, _VettedPlanner(planner, self))
        finally:
            if self.read_ahead is not None:
                self.read_ahead.close()
                self.read_ahead = None

    def _plan_read_ahead(self, plan: LoadPlan) -> _ReadAhead | None:
        """Read ahead, in DCP's order (its reads go file by file, in the order of the plan's
        first item of each), every file of at most ``READ_AHEAD_FILE_BYTES`` that this rank
        checks or of which it reads at least half."""
        if self.manifest is None:
            return None
        wanted: dict[str, int] = {}
        for item in plan.items:
            info = self.storage_data[item.storage_index]
            wanted[info.relative_path] = wanted.get(info.relative_path, 0) + info.length
        checksums = self.manifest.checksum != NO_CHECKSUM
        jobs = []
        for name, wanted_bytes in wanted.items():
            size = self.manifest.files[name].size
            checked = name in self.checks_here
            if size <= READ_AHEAD_FILE_BYTES and (checked or 2 * wanted_bytes >= size):
                jobs.append((self.resolve(name), size, checked and checksums))
        return _ReadAhead(jobs) if jobs else None


class _VettedPlanner:
    """Wraps any load planner: a non-tensor item must pass ``weights_only`` first."""

    def __init__(self, inner: LoadPlanner, reader: VerifiedFileSystemReader):
        self._inner = inner
        self._reader = reader

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        data = value.getvalue()
        if not isinstance(self._inner, SafeLoadPlanner):
            info = self._reader.storage_data[read_item.storage_index]
            where = self._reader.root / info.relative_path
            load_object_safely(data, f"{where}: item {read_item.dest_index.fqn}")
        self._inner.load_bytes(read_item, io.BytesIO(data))
