"""A FileSystemReader that verifies every file it reads and never runs a stored pickle.

Stock DCP loading trusts the files: a flipped byte in a ``.distcp`` file loads silently,
``read_metadata`` calls ``pickle.load`` and ``DefaultLoadPlanner.load_bytes`` calls
``torch.load(weights_only=False)``. Here:

- ``.metadata`` is checked against the manifest, then read by a restricted unpickler;
- every rank checks the size of each data file it opens, and each file's CRC-32 is checked
  once, by one of the ranks that read it (``verify_plan.py``: hashing divided, not repeated
  by every reader; a rank prefers its own files). A failed check fails the load on every
  rank;
- every file is read from one version: the directory is opened once and every file opened
  relative to it, so a save publishing over the path meanwhile cannot mix two checkpoints,
  and the ranks check that they all read the same save (a node of a network filesystem may
  see a new link late);
- the files a rank reads (nearly) whole are read ahead, whole, on a few threads within a
  byte budget (:class:`_ReadAhead`), hashed there, and served from memory: on network
  storage each file's open is a round trip and per-layer files make many, which left the
  link idle between files (a 4-rank FSDP load over sshfs took 1.31x stock's);
- a tensor's bytes go straight from there, or from the file through one reused buffer of
  ``READ_CHUNK_BYTES``, into the destination tensor: no second copy of the tensor is made
  (stock's ``torch.load`` of each item makes one), so the memory a load needs beyond its
  destination is at most the read-ahead budget plus one chunk;
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
import math
import os
import sys
import warnings
import weakref
from collections import deque
from concurrent.futures import Future as PoolFuture
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import BinaryIO, NamedTuple

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from fsdp_ext._torch import (
    log_metadata_error_dcp_load_drops,
    set_state_dict_element,
    stored_tensor_layout,
)
from fsdp_ext.checkpoint.location import posix_storage
from fsdp_ext.checkpoint.manifest import (
    MANIFEST_NAME,
    MARKER,
    METADATA_NAME,
    NO_CHECKSUM,
    CheckpointIntegrityError,
    Manifest,
    UnsafeCheckpointError,
    check_record,
    checksum_bytes,
    crc32,
    crc32_hex,
    parse_manifest,
)
from fsdp_ext.checkpoint.storage import CheckpointStorage, StoredDirectory
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


# Files of at most READ_AHEAD_FILE_BYTES (and of the budget) are read whole ahead of DCP, on
# READ_AHEAD_THREADS threads, holding at most READ_AHEAD_BUDGET bytes, counted from the start
# of a file's read until DCP is done with it. Bigger files are streamed (their open costs
# little against their bytes) through one buffer of READ_CHUNK_BYTES, which the hashing of a
# streamed file reuses.
READ_AHEAD_FILE_BYTES = 256 << 20
READ_AHEAD_THREADS = 4
READ_AHEAD_BUDGET = 512 << 20
READ_CHUNK_BYTES = 16 << 20


class _Fetched(NamedTuple):
    """A file read ahead: its size on disk, its bytes when that size is the expected one, and
    their CRC-32 when asked for."""

    size: int
    data: bytearray | None
    checksum: str | None


def _size(stream: BinaryIO) -> int:
    return stream.seek(0, io.SEEK_END)


def _read_whole(directory: StoredDirectory, name: str, size: int, checksums: bool) -> _Fetched:
    """Reads one file into a buffer of its own (file reads and zlib release the GIL)."""
    with directory.open_read(name) as stream:
        on_disk = _size(stream)
        if on_disk != size:
            return _Fetched(on_disk, None, None)
        data = bytearray(size)
        _read_exactly(stream, memoryview(data), 0)
    return _Fetched(size, data, crc32_hex(crc32(data)) if checksums else None)


def _read_exactly(stream: BinaryIO, view: memoryview, offset: int) -> int:
    """Fills ``view`` from ``offset``; returns how many bytes there were (short at the end)."""
    stream.seek(offset)
    done = 0
    while done < len(view):
        n = stream.readinto(view[done:])
        if not n:
            break
        done += n
    return done


class _ReadAhead:
    """Reads files whole, in the order DCP will ask for them, a few at a time, holding at
    most ``budget`` bytes: a file's bytes count from the start of its read until
    :meth:`release`, once DCP is done with them (not when they are handed over)."""

    def __init__(self, directory: StoredDirectory, jobs: list[tuple[str, int, bool]], budget: int):
        self._directory = directory
        self._pending = deque(jobs)
        # name -> (its read, the slot its bytes land in, size). The bytes go to a slot, not
        # to the future's result: a worker thread still holds the future for a moment after
        # the read, and the bytes must be freed as soon as the reader lets go of them.
        self._started: dict[str, tuple[PoolFuture, list[_Fetched], int]] = {}
        self._held = 0
        self._budget = budget
        self._pool = ThreadPoolExecutor(READ_AHEAD_THREADS, thread_name_prefix="ckpt-read")
        self._start_more()

    def _start_more(self) -> None:
        while self._pending and self._held + self._pending[0][1] <= self._budget:
            name, size, checksums = self._pending.popleft()
            slot: list[_Fetched] = []
            future = self._pool.submit(self._fill, slot, name, size, checksums)
            self._started[name] = (future, slot, size)
            self._held += size

    def _fill(self, slot: list[_Fetched], name: str, size: int, checksums: bool) -> None:
        slot.append(_read_whole(self._directory, name, size, checksums))

    def take(self, name: str) -> _Fetched | None:
        """The file read ahead (waiting for it), or None when it is not; its bytes stay
        counted until :meth:`release`."""
        if name not in self._started:
            self._pending = deque(job for job in self._pending if job[0] != name)
            return None
        future, slot, _ = self._started[name]
        future.result()  # raises what the read raised
        return slot.pop()

    def release(self, name: str) -> None:
        """DCP is done with ``name``: its bytes no longer count, and more files start."""
        entry = self._started.pop(name, None)
        if entry is not None:
            self._held -= entry[2]
            self._start_more()

    def close(self) -> None:
        self._pending.clear()
        self._pool.shutdown(wait=True, cancel_futures=True)


class _FileBytes:
    """The bytes of one data file: in memory when read ahead, else read from the open file."""

    def __init__(
        self, path: Path, *, stream: BinaryIO | None = None, data: bytearray | None = None
    ):
        self.path, self.stream, self.data = path, stream, data

    def readinto(self, offset: int, view: memoryview) -> None:
        if self.data is not None:
            got = max(0, min(len(view), len(self.data) - offset))
            view[:got] = memoryview(self.data)[offset : offset + got]
        else:
            got = _read_exactly(self.stream, view, offset)
        if got != len(view):
            raise CheckpointIntegrityError(
                f"{self.path}: ends before byte {offset + len(view)} that {METADATA_NAME} "
                "says it holds (truncated)"
            )

    def read(self, offset: int, length: int) -> bytes:
        data = bytearray(length)
        self.readinto(offset, memoryview(data))
        return bytes(data)

    def close(self) -> None:
        if self.stream is not None:
            self.stream.close()
        self.stream = self.data = None


class _Window(io.RawIOBase):
    """A seekable read-only file over bytes ``[offset, offset + length)`` of a file: what
    ``torch.load`` reads one item's archive through, without copying it first."""

    def __init__(self, source: _FileBytes, offset: int, length: int):
        super().__init__()
        self._source, self._offset, self._length, self._pos = source, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence]
        self._pos = max(0, base + pos)
        return self._pos

    def readinto(self, buffer) -> int:
        view = memoryview(buffer).cast("B")
        n = max(0, min(len(view), self._length - self._pos))
        self._source.readinto(self._offset + self._pos, view[:n])
        self._pos += n
        return n


def _narrow(tensor: torch.Tensor, offsets, lengths) -> torch.Tensor:
    for dim, (start, length) in enumerate(zip(offsets, lengths, strict=True)):
        tensor = tensor.narrow(dim, start, length)
    return tensor


def _copy_region(source: _FileBytes, base: int, shape, dtype, offsets, lengths, target, chunk):
    """Copies ``stored[offsets : offsets + lengths]`` of a contiguous tensor whose bytes start
    at ``base`` in ``source`` into ``target``, through ``chunk``: whole rows of dim 0 at a
    time, or, when one row is bigger than the chunk, row by row one dimension down."""
    size = dtype.itemsize
    if not shape:
        target.copy_(_chunk_tensor(source, base, size, chunk, dtype).view(()))
        return
    row = math.prod(shape[1:]) * size
    first, count = offsets[0], lengths[0]
    if row > len(chunk):
        for i in range(count):
            at = base + (first + i) * row
            _copy_region(source, at, shape[1:], dtype, offsets[1:], lengths[1:], target[i], chunk)
        return
    per_chunk = len(chunk) // row
    for i in range(0, count, per_chunk):
        rows = min(per_chunk, count - i)
        block = _chunk_tensor(source, base + (first + i) * row, rows * row, chunk, dtype)
        block = block.view(rows, *shape[1:])
        target[i : i + rows].copy_(_narrow(block, [0, *offsets[1:]], [rows, *lengths[1:]]))


class _Chunk:
    """The one buffer of ``READ_CHUNK_BYTES`` a load streams through, made on first use (a
    load whose files are all read ahead needs none)."""

    def __init__(self) -> None:
        self._buffer: bytearray | None = None

    def buffer(self) -> bytearray:
        if self._buffer is None:
            self._buffer = bytearray(READ_CHUNK_BYTES)
        return self._buffer


def _chunk_tensor(source: _FileBytes, offset: int, nbytes: int, chunk: bytearray, dtype):
    source.readinto(offset, memoryview(chunk)[:nbytes])
    return torch.frombuffer(chunk, dtype=dtype, count=nbytes // dtype.itemsize)


class VerifiedFileSystemReader(FileSystemReader):
    """Checks size and checksum of every file it reads; unpickles nothing it need not.

    ``dcp.load(state, storage_reader=VerifiedFileSystemReader(path),
    planner=SafeLoadPlanner())``. Errors: :class:`CheckpointIntegrityError` (missing,
    truncated or altered file, named with expected and found values) and
    :class:`UnsafeCheckpointError` (a pickle that would run code, or metadata that is not
    what DCP writes). A checkpoint saved with ``checksums=False`` is refused unless
    ``require_checksums=False`` (then sizes alone are checked, with a warning).

    The checkpoint's directory (the version a link points to, for what
    ``SpreadFileSystemWriter`` publishes) is opened once, and every file is read relative
    to it, so a save publishing over the path meanwhile cannot mix two checkpoints; the
    ranks check that they all read the same save.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        _extension_registry=None,  # stock's (experimental) stream extensions, passed on
        *,
        require_checksums: bool = True,
        fs: CheckpointStorage | None = None,
    ) -> None:
        if not isinstance(require_checksums, bool):
            raise TypeError(f"require_checksums must be a bool, got {require_checksums!r}")
        if fs is not None and not isinstance(fs, CheckpointStorage):
            raise TypeError(
                f"fs must be a CheckpointStorage (LocalStorage, or another backend), got {fs!r}"
            )
        super().__init__(path, _extension_registry)
        self.fs = posix_storage(fs)
        self.require_checksums = require_checksums
        self.manifest: Manifest | None = None
        self._manifest_loaded = False
        self._directory: StoredDirectory | None = None
        self._close_dir: weakref.finalize | None = None
        self.checks_here: set[str] = set()  # files whose checksum this rank checks

    def reset(self, checkpoint_id=None) -> None:
        super().reset(checkpoint_id)
        self._unpin()
        self.checks_here = set()

    def _unpin(self) -> None:
        """Forgets the opened directory: the next load opens the path afresh."""
        if self._close_dir is not None:
            self._close_dir()
        self.manifest, self._manifest_loaded = None, False
        self._directory, self._close_dir = None, None

    def _pin(self) -> StoredDirectory:
        """Opens the checkpoint's directory once; every later read goes through it."""
        if self._directory is None:
            try:
                directory = self.fs.open_directory(self.path)
            except FileNotFoundError as exc:
                raise CheckpointIntegrityError(
                    f"{self.path}: no such checkpoint directory"
                ) from exc
            self._directory = directory
            self._close_dir = weakref.finalize(self, directory.close)
        return self._directory

    @property
    def root(self) -> Path:
        """The directory files are read from: the version the path linked to when opened."""
        return self._pin().path

    def _open(self, name: str) -> BinaryIO:
        """A file of the pinned directory, opened; a missing one raises naming it."""
        try:
            return self._pin().open_read(name)
        except FileNotFoundError as exc:
            raise self._missing(name) from exc

    def _missing(self, name: str) -> CheckpointIntegrityError:
        path = self.root / name
        if self._pin().removed():
            return CheckpointIntegrityError(
                f"{path}: gone, because {self.root} was removed while being read (pruned, "
                "or replaced by a later save); load again or load another checkpoint"
            )
        record = self.manifest.files.get(name) if self.manifest is not None else None
        expected = f" ({record.size} bytes expected)" if record is not None else ""
        return CheckpointIntegrityError(f"{path}: missing{expected}")

    def _read_small(self, name: str) -> bytes | None:
        """A bookkeeping file's bytes, or None when it does not exist."""
        try:
            stream = self._pin().open_read(name)
        except FileNotFoundError:
            return None
        with stream:
            return stream.read()

    def _load_manifest(self) -> Manifest | None:
        if not self._manifest_loaded:
            data = self._read_small(MANIFEST_NAME)
            if data is not None:
                self.manifest = parse_manifest(data, str(self.root / MANIFEST_NAME))
            self._manifest_loaded = True
        return self.manifest

    def read_metadata(self) -> Metadata:
        # No **kwargs on purpose: dcp.load then does not retry with per-rank metadata files
        # (a format we do not write) and repeat the error.
        try:
            return self._read_verified_metadata()
        except (CheckpointIntegrityError, UnsafeCheckpointError) as exc:
            log_metadata_error_dcp_load_drops(exc)  # torch 2.11 drops it
            raise

    def _read_verified_metadata(self) -> Metadata:
        manifest = self._load_manifest()
        path = self.root / METADATA_NAME
        data = self._read_small(METADATA_NAME)
        if data is None:
            raise CheckpointIntegrityError(
                f"{path}: missing (the save did not finish, or the file was deleted)"
            )
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
        for index, info in self.storage_data.items():
            record = manifest.files.get(info.relative_path)
            if record is None:
                raise CheckpointIntegrityError(
                    f"{self.root / info.relative_path}: referenced by {METADATA_NAME} "
                    f"but not listed in {MANIFEST_NAME}"
                )
            end = info.offset + info.length
            if info.offset < 0 or info.length < 0 or end > record.size:
                raise CheckpointIntegrityError(
                    f"{self.root / info.relative_path}: {METADATA_NAME} puts item {index.fqn} "
                    f"{tuple(index.offset or ())} at bytes {info.offset}..{end}, beyond "
                    f"the file's {record.size} bytes"
                )

    def _identity(self) -> str:
        """What the ranks compare: the save that wrote the directory they read."""
        manifest = self._load_manifest()
        return f"{self.root.name} (save {manifest.save_id})" if manifest else self.root.name

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        reads: dict[str, int] = {}
        for item in plan.items:
            info = self.storage_data[item.storage_index]
            reads[info.relative_path] = reads.get(info.relative_path, 0) + info.length
        return dataclasses.replace(plan, storage_data=(self._identity(), reads))

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        seen: dict[str, list[int]] = {}
        for rank, plan in enumerate(plans):
            seen.setdefault(plan.storage_data[0], []).append(rank)
        if len(seen) > 1:
            views = "; ".join(f"ranks {ranks} read {name}" for name, ranks in seen.items())
            raise CheckpointIntegrityError(
                f"{self.path}: the ranks opened different versions of it ({views}): a save "
                "published over it during the load, or a node of a network filesystem still "
                "sees the previous one (sshfs keeps links up to 20 s); load again"
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

    def _checksum(self, data) -> str | None:
        return None if self.manifest.checksum == NO_CHECKSUM else checksum_bytes(data)

    # -- reading -----------------------------------------------------------------------------

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Reads file by file in the order of the plan (as stock DCP does), each file checked
        before any of its items is handed on."""
        self.checks_here = set(plan.storage_data or ())
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(
                item
            )
        vetted = _VettedPlanner(planner, self)
        chunk = _Chunk()
        read_ahead = self._plan_read_ahead(per_file)
        try:
            for name, items in per_file.items():
                source = self._source(name, read_ahead, chunk)
                try:
                    for item in items:
                        self._read_item(source, item, vetted, chunk)
                finally:
                    source.close()
                    if read_ahead is not None:
                        read_ahead.release(name)
        finally:
            if read_ahead is not None:
                read_ahead.close()
            self._unpin()  # a later load through this reader opens the path afresh
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _plan_read_ahead(self, per_file: dict[str, list[ReadItem]]) -> _ReadAhead | None:
        """Read ahead, in DCP's order, every file of at most ``READ_AHEAD_FILE_BYTES`` (and of
        the budget) that this rank checks or of which it reads at least half."""
        if self.manifest is None:
            return None
        checksums = self.manifest.checksum != NO_CHECKSUM
        jobs = []
        for name, items in per_file.items():
            size = self.manifest.files[name].size
            wanted = sum(self.storage_data[i.storage_index].length for i in items)
            checked = name in self.checks_here
            if size <= min(READ_AHEAD_FILE_BYTES, READ_AHEAD_BUDGET) and (
                checked or 2 * wanted >= size
            ):
                jobs.append((name, size, checked and checksums))
        return _ReadAhead(self._pin(), jobs, READ_AHEAD_BUDGET) if jobs else None

    def _source(self, name: str, read_ahead: _ReadAhead | None, chunk: _Chunk) -> _FileBytes:
        """The file's bytes after its checks: read ahead (checked there), or opened, its size
        checked and, when this rank checks it, hashed in a pass through ``chunk``."""
        path = self.root / name
        record = self.manifest.files[name] if self.manifest is not None else None
        try:
            fetched = read_ahead.take(name) if read_ahead is not None else None
        except FileNotFoundError as exc:
            raise self._missing(name) from exc
        if fetched is not None:
            check_record(str(path), record, fetched.size, fetched.checksum)
            return _FileBytes(path, data=fetched.data)
        source = _FileBytes(path, stream=self._open(name))
        if record is None:
            return source
        try:
            check_record(str(path), record, _size(source.stream), None)
            if name in self.checks_here and self.manifest.checksum != NO_CHECKSUM:
                check_record(str(path), record, record.size, self._hash(source, chunk.buffer()))
        except BaseException:
            source.close()
            raise
        return source

    def _hash(self, source: _FileBytes, chunk: bytearray) -> str:
        view, crc, offset = memoryview(chunk), 0, 0
        while n := _read_exactly(source.stream, view, offset):
            crc = crc32(view[:n], crc)
            offset += n
        return crc32_hex(crc)

    def _read_item(self, source: _FileBytes, item: ReadItem, planner, chunk: _Chunk) -> None:
        info = self.storage_data[item.storage_index]
        window = _Window(source, info.offset, info.length)
        if info.transform_descriptors:
            stream = self.transforms.transform_load_stream(item, info.transform_descriptors, window)
            if item.type == LoadItemType.BYTE_IO:
                planner.load_bytes(item, io.BytesIO(stream.read()))
            else:
                self._copy_loaded(
                    torch.load(io.BytesIO(stream.read()), map_location="cpu", weights_only=True),
                    item,
                    planner,
                )
            return
        if item.type == LoadItemType.BYTE_IO:
            planner.load_bytes(item, io.BytesIO(source.read(info.offset, info.length)))
            return
        layout, at, order = stored_tensor_layout(window)
        target = planner.resolve_tensor(item).detach()
        if tuple(target.shape) != tuple(item.lengths):
            raise AssertionError(
                f"req {item.storage_index} mismatch sizes {tuple(target.shape)} vs "
                f"{tuple(item.lengths)}"
            )
        start = info.offset + at + layout.storage_offset() * layout.dtype.itemsize
        end = start + layout.numel() * layout.dtype.itemsize
        if not _plain(layout, order) or end > info.offset + info.length:
            # anything else (a strided or quantized tensor, bytes of another byte order)
            # loads the stock way: one whole temporary copy of the item
            window.seek(0)
            self._copy_loaded(
                torch.load(window, map_location="cpu", weights_only=True), item, planner, target
            )
            return
        if layout.numel() == 0:
            pass  # nothing to copy
        elif source.data is not None:  # in memory: a view of it, no copy at all
            stored = torch.frombuffer(
                source.data, dtype=layout.dtype, count=layout.numel(), offset=start
            ).view(layout.shape)
            target.copy_(_narrow(stored, item.storage_offsets, item.lengths))
        else:
            _copy_region(
                source,
                start,
                tuple(layout.shape),
                layout.dtype,
                item.storage_offsets,
                item.lengths,
                target,
                chunk.buffer(),
            )
        planner.commit_tensor(item, target)

    def _copy_loaded(self, tensor, item: ReadItem, planner, target=None) -> None:
        target = planner.resolve_tensor(item).detach() if target is None else target
        tensor = _narrow(tensor, item.storage_offsets, item.lengths)
        if target.size() != tensor.size():
            raise AssertionError(
                f"req {item.storage_index} mismatch sizes {target.size()} vs {tensor.size()}"
            )
        target.copy_(tensor)
        planner.commit_tensor(item, target)


def _plain(layout: torch.Tensor, order: str | None) -> bool:
    """The stored bytes are the tensor's elements in order, in this machine's byte order."""
    return (
        layout.layout == torch.strided
        and not layout.is_quantized
        and layout.is_contiguous()
        and order in (None, sys.byteorder)
    )


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
