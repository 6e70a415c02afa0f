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

from fsdp_ext.checkpoint.manifest import UnsafeCheckpointError

_DCP = "torch.distributed.checkpoint"
ALLOWED_GLOBALS: dict[tuple[str, str], object] = {}


def _allow() -> None:
    from torch.distributed.checkpoint import filesystem, metadata

    for name in (
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "_MEM_FORMAT_ENCODING",
    ):
        ALLOWED_GLOBALS[(f"{_DCP}.metadata", name)] = getattr(metadata, name)
    ALLOWED_GLOBALS[(f"{_DCP}.filesystem", "_StorageInfo")] = filesystem._StorageInfo
    ALLOWED_GLOBALS[("torch", "Size")] = torch.Size
    # a lookup of a torch.layout by its name (how torch.layout pickles)
    ALLOWED_GLOBALS[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
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
    """Unpickle ``.metadata`` bytes with :class:`RestrictedUnpickler`; check the type."""
    from torch.distributed.checkpoint.metadata import Metadata

    try:
        metadata = RestrictedUnpickler(io.BytesIO(data), source).load()
    except UnsafeCheckpointError:
        raise
    except Exception as exc:  # truncated or garbled pickle: a corrupt file, not a crash
        from fsdp_ext.checkpoint.manifest import CheckpointIntegrityError

        raise CheckpointIntegrityError(
            f"{source}: not a readable DCP metadata file ({exc})"
        ) from exc
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpointError(
            f"{source}: holds a {type(metadata).__name__}, not DCP Metadata"
        )
    return metadata
