"""Read DCP's ``.metadata`` pickle without running arbitrary code.

Stock ``FileSystemReader.read_metadata`` calls ``pickle.load``, so a ``.metadata`` written by
someone else runs whatever it names. The metadata only ever holds DCP's own dataclasses,
torch sizes/dtypes/layouts and builtin containers; anything else is refused by name before
it is looked up, so its code never runs.
"""

from __future__ import annotations

import builtins
import collections
import io
import pathlib
import pickle

import torch
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from fsdp_ext._torch import DCP_METADATA_PRIVATE_GLOBALS, DcpStorageInfo
from fsdp_ext.checkpoint.manifest import CheckpointIntegrityError, UnsafeCheckpointError

StorageInfo = DcpStorageInfo

_DCP = "torch.distributed.checkpoint"
ALLOWED_GLOBALS: dict[tuple[str, str], object] = {}


def _allow() -> None:
    for name in (
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
    ):
        ALLOWED_GLOBALS[(f"{_DCP}.metadata", name)] = getattr(dcp_metadata, name)
    ALLOWED_GLOBALS.update(DCP_METADATA_PRIVATE_GLOBALS)
    ALLOWED_GLOBALS[("torch", "Size")] = torch.Size
    for name in dir(torch):
        value = getattr(torch, name, None)
        if isinstance(value, torch.dtype | torch.layout | torch.memory_format):
            ALLOWED_GLOBALS[("torch", name)] = value
    for name in ("dict", "list", "tuple", "set", "frozenset", "int", "float", "str", "bool"):
        ALLOWED_GLOBALS[("builtins", name)] = getattr(builtins, name)
    ALLOWED_GLOBALS[("collections", "OrderedDict")] = collections.OrderedDict
    # StorageMeta.checkpoint_id is the path the writer was given, a str or a Path
    ALLOWED_GLOBALS[("pathlib", "PosixPath")] = pathlib.PosixPath


_allow()


class RestrictedUnpickler(pickle.Unpickler):
    """An unpickler whose ``find_class`` knows only ``ALLOWED_GLOBALS``."""

    def __init__(self, file, source: str):
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str):
        found = ALLOWED_GLOBALS.get((module, name))
        if found is None:
            raise UnsafeCheckpointError(
                f"{self.source}: refuses to load the pickle global {module}.{name}; "
                "DCP metadata holds only DCP metadata classes, torch sizes/dtypes and builtins"
            )
        return found


def load_metadata(data: bytes, source: str):
    """Unpickle ``.metadata`` bytes with :class:`RestrictedUnpickler`; check its structure."""
    try:
        metadata = RestrictedUnpickler(io.BytesIO(data), source).load()
    except UnsafeCheckpointError:
        raise
    except Exception as exc:  # truncated or garbled pickle: a corrupt file, not a crash
        raise CheckpointIntegrityError(
            f"{source}: not a readable DCP metadata file ({type(exc).__name__}: {exc})"
        ) from exc
    try:
        check_structure(metadata, source)
    except UnsafeCheckpointError:
        raise
    except Exception as exc:  # an object built without its fields, a size that is no int...
        raise UnsafeCheckpointError(
            f"{source}: holds objects DCP never writes ({type(exc).__name__}: {exc}); refusing it"
        ) from exc
    return metadata


def check_structure(metadata, source: str) -> None:
    """Refuse metadata whose objects are not what DCP writes (a dict where a class belongs,
    a file name leading out of the checkpoint directory, a negative offset, ...): readers
    would fail on them deep inside DCP, or read files elsewhere."""

    def refuse(what: str):
        raise UnsafeCheckpointError(f"{source}: {what}; DCP never writes that, refusing it")

    if not isinstance(metadata, Metadata):
        refuse(f"holds a {type(metadata).__name__}, not DCP Metadata")
    try:
        entries = metadata.state_dict_metadata
        stored = metadata.storage_data
        storage_meta = metadata.storage_meta
    except AttributeError as exc:
        refuse(f"holds a Metadata without its fields ({exc})")
    if not isinstance(entries, dict):
        refuse(f"state_dict_metadata is a {type(entries).__name__}, not a dict")
    for fqn, entry in entries.items():
        if not isinstance(fqn, str):
            refuse(f"a state_dict_metadata key is a {type(fqn).__name__}, not a str")
        if isinstance(entry, TensorStorageMetadata):
            _check_tensor(entry, fqn, refuse)
        elif not isinstance(entry, BytesStorageMetadata):
            refuse(f"item {fqn!r} is described by a {type(entry).__name__}")
    if not isinstance(stored, dict):
        refuse(f"storage_data is a {type(stored).__name__}, not a dict")
    for index, info in stored.items():
        if not (
            isinstance(index, MetadataIndex)
            and isinstance(index.fqn, str)
            and (index.offset is None or _is_size(index.offset))
        ):
            refuse(f"a storage_data key is {index!r}, not a MetadataIndex")
        if not (
            isinstance(info, StorageInfo)
            and isinstance(info.relative_path, str)
            and info.relative_path not in ("", ".", "..")
            and "/" not in info.relative_path
            and "\0" not in info.relative_path
            and _is_count(info.offset)
            and _is_count(info.length)
        ):
            refuse(f"item {index.fqn!r} is stored at {info!r}, not a file in the checkpoint")
    if storage_meta is not None and not isinstance(storage_meta, StorageMeta):
        refuse(f"storage_meta is a {type(storage_meta).__name__}, not a StorageMeta")


def _check_tensor(entry, fqn: str, refuse) -> None:
    try:
        dtype, size, chunks = entry.properties.dtype, entry.size, entry.chunks
    except AttributeError as exc:
        refuse(f"tensor {fqn!r} is missing fields ({exc})")
    if not isinstance(entry.properties, TensorProperties) or not isinstance(dtype, torch.dtype):
        refuse(f"tensor {fqn!r} has properties {entry.properties!r}")
    if not _is_size(size):
        refuse(f"tensor {fqn!r} has size {size!r}")
    if not isinstance(chunks, list):
        refuse(f"tensor {fqn!r} has chunks {type(chunks).__name__}, not a list")
    for chunk in chunks:
        if not (
            isinstance(chunk, ChunkStorageMetadata)
            and _is_size(chunk.offsets)
            and _is_size(chunk.sizes)
            and len(chunk.offsets) == len(size) == len(chunk.sizes)
        ):
            refuse(f"tensor {fqn!r} has a chunk {chunk!r} that does not fit its size {size!r}")


def _is_size(value) -> bool:
    return isinstance(value, torch.Size) and all(_is_count(n) for n in value)


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
