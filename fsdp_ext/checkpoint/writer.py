"""A FileSystemWriter with per-layer files, a checksummed manifest and an atomic overwrite.

Stock ``FileSystemWriter`` writes into the target directory in place and renames only
``.metadata`` at the end, so a crash during an overwrite mixes old and new files. Here a
save writes a complete new version beside the path and publishes it in one atomic step
(``versions.py``: a directory swap, or a link where the filesystem cannot swap; in place,
metadata last, when the path holds files this writer did not write). A save runs:

1. the coordinator, in the global plan step, refuses a path it cannot replace (a regular
   file, a link elsewhere), takes the path's lock (``lock.py``), removes unfinished versions
   of earlier saves, makes the new version directory ``.NAME.v-<save id>`` and records in
   ``.plan.json`` every file each rank will write (one per layer run per rank, at least
   ``thread_count``);
2. every rank writes its files there through ``thread_count`` threads, hashing the bytes as
   they stream out, fsyncs them and leaves a ``.done-rankR.json``;
3. after every rank has reported, the coordinator writes ``.metadata`` (stock format, so the
   stock reader loads it) and ``.manifest.json`` (size and CRC-32 of every file), fsyncs,
   publishes, removes the versions it replaced and releases the lock.

Every storage operation goes through ``self.fs``, a
:class:`~fsdp_ext.checkpoint.storage.CheckpointStorage` (default: the local filesystem).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import pickle
import queue
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from torch.distributed.checkpoint.filesystem import (
    CURRENT_DCP_VERSION,
    DEFAULT_SUFFIX,
    FileSystemWriter,
    SerializationFormat,
)
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from fsdp_ext._torch import write_files
from fsdp_ext.checkpoint.fence import DirectoryFencedError, Fence
from fsdp_ext.checkpoint.file_groups import group_items, safe_name, split_results
from fsdp_ext.checkpoint.layers import LayerKey, default_layer_key, layer_of
from fsdp_ext.checkpoint.location import posix_storage
from fsdp_ext.checkpoint.lock import LockOwner, acquire, release
from fsdp_ext.checkpoint.manifest import (
    CHECKSUM,
    MANIFEST_NAME,
    MARKER,
    METADATA_NAME,
    NO_CHECKSUM,
    PLAN_NAME,
    CheckpointSpaceError,
    FileRecord,
    Manifest,
    plan_record_bytes,
)
from fsdp_ext.checkpoint.planner import item_key, item_nbytes
from fsdp_ext.checkpoint.serialize import write_items
from fsdp_ext.checkpoint.storage import MISSING, CheckpointStorage, is_out_of_space
from fsdp_ext.checkpoint.versions import (
    IN_PLACE,
    LINKED,
    MANIFEST_TEMP,
    METADATA_TEMP,
    choose_layout,
    in_place_file_name,
    inspect_target,
    publish,
    remove_leftovers,
    sweep_in_place,
    version_name,
)

_FILE_RECORD_PREFIX = "\0fsdp_ext.file\0"
_OTHER = "other"


@dataclass
class _RankFiles:
    """What the coordinator tells one rank: where to write, and which items go in which file."""

    staging: str
    files: list[tuple[str, list[tuple]]]  # (file name, item keys)
    layers: dict[str, list[str]]


@dataclass
class _Save:
    """The coordinator's state of one save, from the global plan to the publish."""

    target: Path
    staging: Path  # the new version's directory; the path itself when in place
    save_id: str
    owner: LockOwner
    previous: str | None  # where the previous checkpoint is after the publish (manifest)
    expected: dict  # every file each rank will write (also in the plan record)
    layout: str  # versions.SWAP, LINKED or IN_PLACE
    replaced: Manifest | None  # in place: the manifest of ours the save replaces


def rank_done_name(rank: int) -> str:
    return f".done-rank{rank}.json"


def new_save_id() -> str:
    """Sortable by time, unique by its random tail: ``20261123T215612-1a2b3c4d``."""
    return f"{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:8]}"


class SpreadFileSystemWriter(FileSystemWriter):
    """Per-layer files, a manifest with checksums, and an atomic overwrite.

    Save with ``dcp.save(state, storage_writer=SpreadFileSystemWriter(path),
    planner=SpreadSavePlanner())`` or ``dcp.async_save`` (thread or process mode). Load with
    :class:`~fsdp_ext.checkpoint.VerifiedFileSystemReader` (checked) or the stock
    ``FileSystemReader`` (unchecked). ``checksums=False`` keeps the manifest's sizes but
    skips the hashing (for measuring its cost; the verified reader then refuses to load
    unless told ``require_checksums=False``). Files hold runs of whole layers of at least
    ``min_file_bytes`` (0: one file per layer per rank). ``fs`` replaces the filesystem
    operations (default: :class:`~fsdp_ext.checkpoint.fs.LocalStorage`); any
    :class:`~fsdp_ext.checkpoint.storage.CheckpointStorage` puts checkpoints elsewhere.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        single_file_per_rank: bool = True,
        sync_files: bool = True,
        thread_count: int = 1,
        per_thread_copy_ahead: int = 10_000_000,
        cache_staged_state_dict: bool = False,
        overwrite: bool = True,
        _extensions=None,
        serialization_format: SerializationFormat = SerializationFormat.TORCH_SAVE,
        *,
        layer_key: LayerKey | None = default_layer_key,
        checksums: bool = True,
        min_file_bytes: int | None = None,
        fs: CheckpointStorage | None = None,
        fence: Fence | None = None,
    ) -> None:
        """Stock ``FileSystemWriter``'s arguments, in its order, then ours.

        ``single_file_per_rank=False`` (stock: one file per item) gives one file per layer
        per rank (``min_file_bytes=0``), the finest split this writer makes; an explicit
        ``min_file_bytes`` wins. ``overwrite=False`` raises stock's ``RuntimeError``
        ("Checkpoint already exists and self.overwrite=False.") when a checkpoint is there.
        """
        if not isinstance(thread_count, int) or thread_count < 1:
            raise ValueError(f"thread_count must be a positive int, got {thread_count!r}")
        if layer_key is not None and not callable(layer_key):
            raise TypeError(
                f"layer_key must be a callable fqn -> layer id or None, got {layer_key!r}"
            )
        if not isinstance(checksums, bool):
            raise TypeError(f"checksums must be a bool, got {checksums!r}")
        if fs is not None and not isinstance(fs, CheckpointStorage):
            raise TypeError(
                f"fs must be a CheckpointStorage (LocalStorage, or another backend), got {fs!r}"
            )
        if min_file_bytes is None:
            min_file_bytes = 64 << 20 if single_file_per_rank else 0
        if not isinstance(min_file_bytes, int) or min_file_bytes < 0:
            raise ValueError(f"min_file_bytes must be an int >= 0, got {min_file_bytes!r}")
        super().__init__(
            path,
            single_file_per_rank=single_file_per_rank,
            sync_files=sync_files,
            thread_count=thread_count,
            per_thread_copy_ahead=per_thread_copy_ahead,
            cache_staged_state_dict=cache_staged_state_dict,
            overwrite=overwrite,
            _extensions=_extensions,
            serialization_format=serialization_format,
        )
        self.layer_key = layer_key
        self.checksums = checksums
        self.min_file_bytes = min_file_bytes
        self.fs = posix_storage(fs)
        self.fs.checksums = checksums
        self.fence = fence
        torch_save = serialization_format == SerializationFormat.TORCH_SAVE
        self._stock_loop = bool(_extensions) or not torch_save
        self._save: _Save | None = None

    # -- local and global plan -------------------------------------------------------------

    def set_up_storage_writer(self, is_coordinator: bool, *args, **kwargs) -> None:
        super().set_up_storage_writer(is_coordinator, *args, **kwargs)
        if not self.use_collectives:
            raise ValueError(
                "SpreadFileSystemWriter needs use_collectives=True (one global commit)"
            )

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan  # the coordinator makes the version directory; nothing at the path yet

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        if not all(getattr(p, "usable", True) for p in plans):
            raise ValueError(
                "a rank sent no plan (DefaultSavePlanner(enable_plan_caching=True) skips an "
                "unchanged one), but SpreadFileSystemWriter writes every save into a new "
                "version directory named in the plans: pass enable_plan_caching=False, or "
                "use SpreadSavePlanner, which accepts and ignores it"
            )
        fs, target, fence = self.fs, Path(self.path), self.fence
        if fence is not None:
            fence.check()
        inspect_target(fs, target, overwrite=self.overwrite)  # refuse before writing anything
        fs.makedirs(target.parent)
        save_id = new_save_id()
        owner = LockOwner.here(save_id, generation=0 if fence is None else fence.generation)
        scratch = None if fence is None else fence.work_dir
        acquire(fs, target, owner)
        layout, staging = None, None
        try:
            found = inspect_target(fs, target, overwrite=self.overwrite)
            layout = choose_layout(fs, target, found, save_id)
            remove_leftovers(fs, target, keep=found.version, published=False, scratch=scratch)
            if layout == IN_PLACE:
                sweep_in_place(fs, target, found.manifest)  # what a killed save left here
                staging, previous = target, None
            else:
                staging = (scratch or target.parent) / version_name(target.name, save_id)
                # the manifest's ``replaces``: where the previous checkpoint is once this
                # save publishes: the old link's version, or (a directory swapped) this
                # version's own name
                previous = found.version
                if found.kind == "ours":
                    previous = staging.name
            out, expected = [], {}
            tag = save_id if layout == IN_PLACE else None
            for rank, plan in enumerate(plans):
                assignment = self._assign_files(rank, plan, str(staging), tag)
                for name, keys in assignment.files:
                    expected[name] = {
                        "rank": rank,
                        "items": len(keys),
                        "layers": assignment.layers[name],
                    }
                out.append(dataclasses.replace(plan, storage_data=assignment))
            record = {
                "target": target.name,
                "save_id": save_id,
                "replaces": previous,
                "world_size": len(plans),
                "files": expected,
            }
            if layout != IN_PLACE:
                fs.make_dir(staging)
            fs.write_file(
                staging / PLAN_NAME,
                plan_record_bytes(record),
                False,  # diagnostic: a plan lost on power loss reads as an empty version
            )
        except BaseException:
            if layout not in (None, IN_PLACE) and fs.kind(staging) != MISSING:
                fs.remove_tree(staging)
            release(fs, target, owner)
            raise
        replaced = found.manifest if layout == IN_PLACE else None
        self._save = _Save(target, staging, save_id, owner, previous, expected, layout, replaced)
        return out

    def _assign_files(self, rank: int, plan: SavePlan, staging: str, tag: str | None) -> _RankFiles:
        """Runs of whole layers per file (``file_groups.py``). ``tag`` (in place: the save
        id) makes the names unique to this save."""
        bins = group_items(plan, self.layer_key, self.min_file_bytes, self.thread_count)
        files, layers = [], {}
        for name, items in bins:
            file_name = f"__{rank}_{safe_name(name)}{DEFAULT_SUFFIX}"
            if tag is not None:
                file_name = in_place_file_name(f"__{rank}_{safe_name(name)}", tag, DEFAULT_SUFFIX)
            files.append((file_name, [item_key(i.index) for i in items]))
            found = {layer_of(self.layer_key, i.index.fqn) for i in items}
            layers[file_name] = sorted(x for x in found if x is not None)
        return _RankFiles(staging, files, layers)

    # -- writing ---------------------------------------------------------------------------

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        assignment: _RankFiles = plan.storage_data
        staging = Path(assignment.staging)
        by_key = {item_key(i.index): i for i in plan.items}
        files = [(staging / n, n, [by_key[k] for k in keys]) for n, keys in assignment.files]
        need = sum(item_nbytes(i) for i in plan.items)
        # fsync once every file is written, not after each one (what the stock loop does), so
        # the kernel flushes one file while the next is being written
        sync, self.sync_files = self.sync_files, False
        try:
            results = self._write_files(planner, files)
            for file_name, _keys in assignment.files:
                if sync:
                    self.fs.fsync(staging / file_name)
        except BaseException as exc:
            space = [(p, e) for p, e in self.fs.write_errors.items() if is_out_of_space(e)]
            if space:
                raise self._out_of_space(space[0][0], space[0][1], need) from exc
            if is_out_of_space(exc):
                raise self._out_of_space(str(staging), exc, need) from exc
            raise
        finally:
            self.sync_files = sync
        for file_name, keys in assignment.files:
            size, checksum = self.fs.records[str(staging / file_name)]
            record = FileRecord(
                name=file_name,
                rank=self.rank or 0,
                size=size,
                checksum=checksum or "",
                layers=assignment.layers[file_name],
                items=len(keys),
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
        self.fs.write_file(
            staging / rank_done_name(self.rank or 0),
            json.dumps(done).encode(),
            False,  # diagnostic only: losing it on power loss just reads as "unfinished"
        )
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def _write_files(self, planner: SavePlanner, files: list[tuple[Path, str, list]]) -> list:
        """Every file through ``thread_count`` threads; their write results. Tensors are
        written from their own memory without the zip CRC (``serialize.py``); an extension
        or another serialization format takes the stock loop."""
        pending: queue.Queue = queue.Queue()
        for entry in files:
            pending.put(entry)
        if self._stock_loop:
            return write_files(self, planner, pending).value()
        results: list[WriteResult] = []
        errors: list[BaseException] = []

        def work() -> None:
            try:
                while not errors:
                    try:
                        path, name, items = pending.get_nowait()
                    except queue.Empty:
                        return
                    with self.fs.create_stream(path, "wb") as stream:
                        results.extend(write_items(stream, name, items, planner))
            except BaseException as exc:  # raised by the calling thread below
                errors.append(exc)

        helpers = [
            threading.Thread(target=work, name="fsdp_ext-write", daemon=True)
            for _ in range(1, self.thread_count)
        ]
        for thread in helpers:
            thread.start()
        work()
        for thread in helpers:
            thread.join()
        if errors:
            raise errors[0]
        return results

    def _out_of_space(self, path: str, exc: OSError, need: int) -> CheckpointSpaceError:
        try:
            free = f"{self.fs.free_bytes(Path(self.path).parent)} bytes are free now"
        except OSError:
            free = "the free space could not be read"
        return CheckpointSpaceError(
            errno.ENOSPC,
            f"{path}: no space left on the device ({exc.strerror or exc}); this rank's "
            f"files need about {need} bytes and {free}. An overwrite keeps the previous "
            "checkpoint until the new one is published, so the device needs room for both",
        )

    def abandon(self) -> None:
        """After a save that failed (DCP calls no writer method then): remove what it staged
        and release its lock, so that nothing of it is left to fill the disk."""
        save, self._save = self._save, None
        if save is None:
            return
        try:
            if save.layout != IN_PLACE and self.fs.kind(save.staging) != MISSING:
                self.fs.remove_tree(save.staging, missing_ok=True)
        except OSError:
            pass  # the next save of this path removes it (remove_leftovers)
        finally:
            release(self.fs, save.target, save.owner)

    # -- commit ----------------------------------------------------------------------------

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Write .metadata and the manifest into the version directory, then publish it."""
        save = self._save
        if save is None:
            raise RuntimeError("finish() without prepare_global_plan(): not the coordinator")
        scratch = None if self.fence is None else self.fence.work_dir
        try:
            manifest = self._complete(save, metadata, results)
            if save.layout == IN_PLACE:
                # earlier saves' files
                sweep_in_place(self.fs, save.target, manifest, save.replaced)
            else:
                publish(
                    self.fs,
                    save.target,
                    save.staging.name,
                    save.save_id,
                    self.sync_files,
                    save.layout,
                    scratch,
                )
            keep = save.staging.name if save.layout == LINKED else None
            remove_leftovers(self.fs, save.target, keep=keep, published=True, scratch=scratch)
        except OSError as exc:
            if is_out_of_space(exc):
                raise self._out_of_space(str(save.staging), exc, 0) from exc
            lost = None if self.fence is None else self.fence.lost()
            if lost is not None:
                raise DirectoryFencedError(lost) from exc
            raise
        finally:
            release(self.fs, save.target, save.owner)
            self._save = None

    def _complete(
        self, save: _Save, metadata: Metadata, results: list[list[WriteResult]]
    ) -> Manifest:
        """Write ``.metadata`` and the manifest. In a version directory, the manifest's
        rename makes it complete; in place, the manifest is renamed into place, then
        ``.metadata``, last (stock's commit point)."""
        fs, staging = self.fs, save.staging
        in_place = save.layout == IN_PLACE
        records, storage_data = split_results(results, _FILE_RECORD_PREFIX)
        missing = sorted(set(save.expected) - set(records))
        if missing:
            raise RuntimeError(
                f"ranks did not report files {missing}; not publishing {save.target}"
            )
        metadata.version = CURRENT_DCP_VERSION
        metadata.storage_data = storage_data
        metadata.storage_meta = self.storage_meta()
        # stock format: plain pickle, so the stock FileSystemReader loads it. Written under
        # its own name: the version is invisible until published, and it counts as complete
        # only once the manifest (renamed into place below) exists.
        meta_path = staging / (METADATA_TEMP if in_place else METADATA_NAME)
        with fs.create_stream(meta_path, "wb") as stream:
            pickle.dump(metadata, stream)
            if self.sync_files:
                stream.flush()
                fs.fsync(meta_path)
        size, checksum = fs.records[str(meta_path)]
        manifest = Manifest(
            files=records,
            metadata=FileRecord(METADATA_NAME, rank=-1, size=size, checksum=checksum or ""),
            world_size=len(results),
            checksum=CHECKSUM if self.checksums else NO_CHECKSUM,
            target=save.target.name,
            save_id=save.save_id,
            replaces=save.previous,
        )
        tmp = staging / MANIFEST_TEMP
        fs.write_file(tmp, manifest.to_json().encode(), self.sync_files)
        fs.rename(tmp, staging / MANIFEST_NAME)
        if in_place:
            fs.rename(meta_path, staging / METADATA_NAME)
        fs.unlink(staging / PLAN_NAME)
        for rank in range(len(results)):
            with contextlib.suppress(FileNotFoundError):  # diagnostic, not fsynced
                fs.unlink(staging / rank_done_name(rank))
        if self.sync_files:
            fs.fsync(staging)
        return manifest

    def storage_meta(self) -> StorageMeta:
        # the marker lets a reader tell "manifest deleted" from "a stock checkpoint"
        return StorageMeta(checkpoint_id=str(self.path), save_id=self.save_id, modules=[MARKER])

    def reset(self, checkpoint_id=None) -> None:
        super().reset(checkpoint_id)
        self.fs.records.clear()
        self.fs.write_errors.clear()
