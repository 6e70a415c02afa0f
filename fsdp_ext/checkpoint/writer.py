"""A FileSystemWriter with per-layer files, a checksummed manifest and an atomic publish.

Stock ``FileSystemWriter`` writes into the target directory in place and renames only
``.metadata`` at the end, so a crash during an overwrite mixes old and new files. Here:

1. the coordinator, in the global plan step, makes a staging directory beside the target
   (``.NAME.partial-<save id>``), names every file each rank will write (one per layer
   group per rank, at least ``thread_count`` per rank) and records them in ``.plan.json``;
2. every rank writes its files there through ``thread_count`` threads, hashing the bytes as
   they stream out;
3. after every rank has reported, the coordinator writes ``.metadata`` (stock format, so the
   stock reader loads it) and ``.manifest.json`` (size and CRC-32 of every file), fsyncs,
   and renames the staging directory onto the target. An existing target is first moved
   aside, then removed once the new one is in place.

A save that dies before step 3 leaves the target untouched and a staging directory that
``verify_checkpoint`` reports as unfinished, naming the files that are missing.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import queue
import shutil
import threading
import zlib
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from torch.distributed.checkpoint.filesystem import (
    CURRENT_DCP_VERSION,
    DEFAULT_SUFFIX,
    FileSystem,
    FileSystemWriter,
    _item_size,
)
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from fsdp_ext.checkpoint.layers import LayerKey, default_layer_key
from fsdp_ext.checkpoint.manifest import (
    CHECKSUM,
    MANIFEST_NAME,
    MARKER,
    METADATA_NAME,
    NO_CHECKSUM,
    PLAN_NAME,
    FileRecord,
    Manifest,
    crc32_hex,
)
from fsdp_ext.checkpoint.planner import item_key

_FILE_RECORD_PREFIX = "\0fsdp_ext.file\0"
_OTHER = "other"


@dataclass
class _RankFiles:
    """What the coordinator tells one rank: where to write, and which items go in which file."""

    staging: str
    files: list[tuple[str, list[tuple]]]  # (file name, item keys)
    layers: dict[str, list[str]]


def rank_done_name(rank: int) -> str:
    return f".done-rank{rank}.json"


def staging_prefix(target: Path) -> str:
    return f".{target.name}.partial-"


class _ChecksumStream:
    """A write-only file that keeps the CRC-32 and length of every byte written to it."""

    def __init__(self, raw, on_close):
        self._raw = raw
        self._on_close = on_close
        self.crc = 0
        self.size = 0

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        written = self._raw.write(view)
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
        if not self._raw.closed:
            self._raw.close()
            self._on_close(self)

    @property
    def closed(self) -> bool:
        return self._raw.closed


class _ChecksummingFileSystem(FileSystem):
    """Streams opened for writing record (size, crc) per path when they close."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.records: dict[str, tuple[int, str | None]] = {}
        self._lock = threading.Lock()

    @contextmanager
    def create_stream(self, path, mode: str) -> Iterator:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        raw = open(path, mode)  # noqa: SIM115 (closed by the wrapper)

        def record(stream: _ChecksumStream) -> None:
            with self._lock:
                self.records[str(path)] = (
                    stream.size,
                    crc32_hex(stream.crc) if self.enabled else None,
                )

        stream = _ChecksumStream(raw, record)
        try:
            yield stream
        finally:
            stream.close()


class SpreadFileSystemWriter(FileSystemWriter):
    """Per-layer files, a manifest with checksums, and an atomic publish of the directory.

    Save with ``dcp.save(state, storage_writer=SpreadFileSystemWriter(path),
    planner=SpreadSavePlanner())`` or ``dcp.async_save`` (staging included). Load with
    :class:`~fsdp_ext.checkpoint.VerifiedFileSystemReader` (checked) or the stock
    ``FileSystemReader`` (unchecked). ``checksums=False`` keeps the manifest's sizes but
    skips the hashing (for measuring its cost). Files hold runs of whole layers of at least
    ``min_file_bytes`` (0: one file per layer per rank).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        layer_key: LayerKey | None = default_layer_key,
        checksums: bool = True,
        min_file_bytes: int = 64 << 20,
        thread_count: int = 1,
        sync_files: bool = True,
        overwrite: bool = True,
        **kwargs,
    ) -> None:
        if not isinstance(thread_count, int) or thread_count < 1:
            raise ValueError(f"thread_count must be a positive int, got {thread_count!r}")
        if layer_key is not None and not callable(layer_key):
            raise TypeError(
                f"layer_key must be a callable fqn -> layer id or None, got {layer_key!r}"
            )
        if kwargs.get("single_file_per_rank") is False:
            raise ValueError("single_file_per_rank=False is not supported: files are per layer")
        kwargs.pop("single_file_per_rank", None)
        super().__init__(
            path,
            thread_count=thread_count,
            sync_files=sync_files,
            overwrite=overwrite,
            **kwargs,
        )
        self.layer_key = layer_key
        self.checksums = checksums
        if not isinstance(min_file_bytes, int) or min_file_bytes < 0:
            raise ValueError(f"min_file_bytes must be an int >= 0, got {min_file_bytes!r}")
        self.min_file_bytes = min_file_bytes
        self.fs = _ChecksummingFileSystem(checksums)

    # -- local and global plan -------------------------------------------------------------

    def set_up_storage_writer(self, is_coordinator: bool, *args, **kwargs) -> None:
        super().set_up_storage_writer(is_coordinator, *args, **kwargs)
        if not self.use_collectives:
            raise ValueError(
                "SpreadFileSystemWriter needs use_collectives=True (one global commit)"
            )

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        target = Path(self.path)
        if target.exists() and not self.overwrite:
            raise RuntimeError(f"checkpoint {target} already exists and overwrite=False")
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        target = Path(self.path)
        target.parent.mkdir(parents=True, exist_ok=True)
        for stale in target.parent.glob(staging_prefix(target) + "*"):
            shutil.rmtree(stale, ignore_errors=True)  # a save that died earlier
        staging = target.parent / f"{staging_prefix(target)}{self.save_id}"
        staging.mkdir()
        out, expected = [], {}
        for rank, plan in enumerate(plans):
            assignment = self._assign_files(rank, plan, str(staging))
            for name, keys in assignment.files:
                expected[name] = {
                    "rank": rank,
                    "items": len(keys),
                    "layers": assignment.layers[name],
                }
            out.append(dataclasses.replace(plan, storage_data=assignment))
        plan_record = {"target": target.name, "world_size": len(plans), "files": expected}
        self._staging = str(staging)
        (staging / PLAN_NAME).write_text(json.dumps(plan_record, indent=1, sort_keys=True) + "\n")
        return out

    def _assign_files(self, rank: int, plan: SavePlan, staging: str) -> _RankFiles:
        """Runs of whole layers, in layer order, of at least ``min_file_bytes`` each.

        Every file costs an open, a zip header and an fsync; one file per layer would make
        a small model's save slower than stock's one file per rank. Then the largest file is
        halved until each of the ``thread_count`` writer threads has one.
        """
        groups: dict[str, list] = defaultdict(list)
        for item in plan.items:
            layer = self.layer_key(item.index.fqn) if self.layer_key else None
            groups[layer or _OTHER].append(item)
        bins: list[tuple[str, list]] = []
        run_names: list[str] = []
        for name in sorted(groups, key=_natural):
            if run_names and sum(_nbytes(i) for i in bins[-1][1]) < self.min_file_bytes:
                run_names.append(name)
                bins[-1] = (f"{run_names[0]}..{name}", bins[-1][1] + groups[name])
            else:
                run_names = [name]
                bins.append((name, list(groups[name])))
        while len(bins) < self.thread_count:
            name, items = max(
                bins, key=lambda b: (sum(_nbytes(i) for i in b[1]), b[0]), default=(None, [])
            )
            if len(items) < 2:
                break
            halves: tuple[list, list] = ([], [])
            sizes = [0, 0]
            for item in sorted(items, key=lambda i: -_nbytes(i)):
                k = 0 if sizes[0] <= sizes[1] else 1
                halves[k].append(item)
                sizes[k] += _nbytes(item)
            bins.remove((name, items))
            bins += [(f"{name}-a", halves[0]), (f"{name}-b", halves[1])]
        files, layers = [], {}
        for name, items in bins:
            file_name = f"__{rank}_{_safe(name)}{DEFAULT_SUFFIX}"
            files.append((file_name, [item_key(i.index) for i in items]))
            found = {self.layer_key(i.index.fqn) for i in items} if self.layer_key else set()
            layers[file_name] = sorted(x for x in found if x is not None)
        return _RankFiles(staging, files, layers)

    # -- writing ---------------------------------------------------------------------------

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        assignment: _RankFiles = plan.storage_data
        by_key = {item_key(i.index): i for i in plan.items}
        file_queue: queue.Queue = queue.Queue()
        for file_name, keys in assignment.files:
            path = os.path.join(assignment.staging, file_name)
            file_queue.put((path, file_name, [by_key[k] for k in keys]))
        # fsync once every file is written, not after each one (what the stock loop does), so
        # the kernel flushes one file while the next is being written
        sync, self.sync_files = self.sync_files, False
        try:
            results = self._write_data(planner, file_queue).value()
        finally:
            self.sync_files = sync
        for file_name, _keys in assignment.files:
            _fsync_path(Path(assignment.staging) / file_name, sync)
            size, checksum = self.fs.records[os.path.join(assignment.staging, file_name)]
            record = FileRecord(
                name=file_name,
                rank=self.rank or 0,
                size=size,
                checksum=checksum or "",
                layers=assignment.layers[file_name],
                items=len(_keys),
            )
            results.append(
                WriteResult(
                    index=MetadataIndex(_FILE_RECORD_PREFIX + file_name),
                    size_in_bytes=size,
                    storage_data=record,
                )
            )
        # lets verify_checkpoint tell, after a crash, which ranks finished their files
        done = [
            asdict(r.storage_data) for r in results if r.index.fqn.startswith(_FILE_RECORD_PREFIX)
        ]
        _write_synced(
            Path(assignment.staging) / rank_done_name(self.rank or 0),
            json.dumps(done).encode(),
            False,  # diagnostic only: losing it on power loss just reads as "unfinished"
        )
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    # -- commit ----------------------------------------------------------------------------

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Write .metadata and the manifest into the staging dir, then publish it."""
        records: dict[str, FileRecord] = {}
        storage_data = {}
        for rank_results in results:
            for wr in rank_results:
                if wr.index.fqn.startswith(_FILE_RECORD_PREFIX):
                    records[wr.storage_data.name] = wr.storage_data
                else:
                    storage_data[wr.index] = wr.storage_data
        staging, target = Path(self._staging), Path(self.path)
        expected = json.loads((staging / PLAN_NAME).read_text())["files"]
        missing = sorted(set(expected) - set(records))
        if missing:
            raise RuntimeError(f"ranks did not report files {missing}; not publishing {target}")
        metadata.version = CURRENT_DCP_VERSION
        metadata.storage_data = storage_data
        metadata.storage_meta = self.storage_meta()
        # stock format: plain pickle, so the stock FileSystemReader loads it
        with self.fs.create_stream(staging / f"{METADATA_NAME}.tmp", "wb") as stream:
            pickle.dump(metadata, stream)
            if self.sync_files:
                stream.flush()
                os.fsync(stream.fileno())
        os.replace(staging / f"{METADATA_NAME}.tmp", staging / METADATA_NAME)
        size, checksum = self.fs.records[str(staging / f"{METADATA_NAME}.tmp")]
        manifest = Manifest(
            files=records,
            metadata=FileRecord(METADATA_NAME, rank=-1, size=size, checksum=checksum or ""),
            world_size=len(results),
            checksum=CHECKSUM if self.checksums else NO_CHECKSUM,
        )
        _write_synced(staging / MANIFEST_NAME, manifest.to_json().encode(), self.sync_files)
        (staging / PLAN_NAME).unlink()
        for done in staging.glob(rank_done_name(0).replace("0", "*")):
            done.unlink()
        _fsync_path(staging, self.sync_files)
        _publish(staging, target, self.sync_files)

    def storage_meta(self) -> StorageMeta:
        # the marker lets a reader tell "manifest deleted" from "a stock checkpoint"
        return StorageMeta(checkpoint_id=str(self.path), save_id=self.save_id, modules=[MARKER])

    def reset(self, checkpoint_id=None) -> None:
        super().reset(checkpoint_id)
        self.fs.records.clear()


def _nbytes(item) -> int:
    return 0 if item.type == WriteItemType.BYTE_IO else _item_size(item)


def _natural(name: str) -> tuple:
    """ "other" first, then layers by number: layers.2 before layers.10."""
    head, _, tail = name.rpartition(".")
    return (name != _OTHER, head, int(tail) if tail.isdigit() else -1, name)


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in name)


def _write_synced(path: Path, data: bytes, sync: bool) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        if sync:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_path(path: Path, sync: bool) -> None:
    """fsync a file or a directory by path (a directory, so that renames in it persist)."""
    if not sync:
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _publish(staging: Path, target: Path, sync: bool) -> None:
    """Rename the finished staging dir onto the target; an old target is moved aside first."""
    old = None
    if target.exists():
        old = target.parent / f".{target.name}.replaced-{staging.name.rsplit('-', 1)[-1]}"
        if target.is_dir():
            os.rename(target, old)
        else:
            raise RuntimeError(f"{target} exists and is not a directory; not replacing it")
    os.rename(staging, target)
    _fsync_path(target.parent, sync)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
