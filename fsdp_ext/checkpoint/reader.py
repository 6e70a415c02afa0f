"""A FileSystemReader that verifies every file it reads and never runs a stored pickle.

Stock DCP loading trusts the files: a flipped byte in a ``.distcp`` file loads silently,
``read_metadata`` calls ``pickle.load`` and ``DefaultLoadPlanner.load_bytes`` calls
``torch.load(weights_only=False)``. Here:

- ``.metadata`` is checked against the manifest, then read by a restricted unpickler;
- each data file is read once, whole, checked (size, CRC-32) and served from memory, so
  what was checked is what is loaded;
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
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

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
    read_manifest,
)
from fsdp_ext.checkpoint.unpickler import load_metadata


def load_object_safely(data: bytes, what: str):
    """``torch.load(weights_only=True)``, with a refusal that names the item."""
    try:
        return torch.load(io.BytesIO(data), weights_only=True)
    except Exception as exc:
        raise UnsafeCheckpointError(
            f"{what}: refused to unpickle a non-tensor item outside the weights_only allowlist "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); "
            "allow its types with torch.serialization.add_safe_globals if you trust them"
        ) from exc


class SafeLoadPlanner(DefaultLoadPlanner):
    """A ``DefaultLoadPlanner`` whose non-tensor items load with ``weights_only=True``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        obj = load_object_safely(value.getvalue(), f"item {read_item.dest_index.fqn}")
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._traverse import set_element

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


class _VerifiedFileSystem(FileSystem):
    """Serves each data file from memory after checking it against the manifest."""

    def __init__(self, reader: VerifiedFileSystemReader):
        self.reader = reader

    @contextmanager
    def create_stream(self, path, mode: str):
        manifest = self.reader.manifest
        if "r" not in mode or manifest is None:
            with super().create_stream(self.reader.resolve(path), mode) as stream:
                yield stream
            return
        yield io.BytesIO(self.reader.verified_bytes(self.reader.resolve(path)))


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
        self, path: str | os.PathLike, *, require_checksums: bool = True, **kwargs
    ) -> None:
        if not isinstance(require_checksums, bool):
            raise TypeError(f"require_checksums must be a bool, got {require_checksums!r}")
        super().__init__(path, **kwargs)
        self.fs = _VerifiedFileSystem(self)
        self.require_checksums = require_checksums
        self.manifest: Manifest | None = None
        self._manifest_loaded = False
        self._root: Path | None = None

    def reset(self, checkpoint_id=None) -> None:
        super().reset(checkpoint_id)
        self.manifest, self._manifest_loaded, self._root = None, False, None

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
        return dataclasses.replace(plan, storage_data=self.root.name)

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        seen: dict[str, list[int]] = {}
        for rank, plan in enumerate(plans):
            seen.setdefault(plan.storage_data, []).append(rank)
        if len(seen) > 1:
            views = "; ".join(f"ranks {ranks} read {name}" for name, ranks in seen.items())
            raise CheckpointIntegrityError(
                f"{self.path}: the ranks resolved it to different versions ({views}): a save "
                "published over it during the load, or a node of a network filesystem still "
                "sees the previous link (sshfs keeps links up to 20 s); load again"
            )
        return plans

    def verified_bytes(self, path: Path) -> bytes:
        record = self.manifest.files[path.name]
        if not path.is_file():
            raise CheckpointIntegrityError(f"{path}: missing ({record.size} bytes expected)")
        data = path.read_bytes()
        check_record(str(path), record, len(data), self._checksum(data))
        return data

    def _checksum(self, data: bytes) -> str | None:
        return None if self.manifest.checksum == NO_CHECKSUM else checksum_bytes(data)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        return super().read_data(plan, _VettedPlanner(planner, self))


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
