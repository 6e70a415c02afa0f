"""Read DCP's ``.metadata`` pickle, and non-tensor items, without running arbitrary code.

Stock ``FileSystemReader.read_metadata`` calls ``pickle.load``, so a ``.metadata`` written by
someone else runs whatever it names. Here a pickle must pass two gates before it is loaded:

- **opcodes**: the stream is walked with ``pickletools.genops`` (which parses, never runs) and
  every opcode must be on :data:`ALLOWED_OPCODES`, the ones DCP metadata and plain data need.
  The EXT opcodes (``copyreg``'s extension registry, whose warm cache hands back an object
  without asking ``find_class``), persistent ids, ``INST``/``OBJ`` and out-of-band buffers
  are refused before the first opcode runs;
- **globals**: ``find_class`` knows DCP's metadata classes (of this and of older torch
  releases), torch sizes/dtypes/layouts, builtin containers, and whatever the user allowed
  the standard way (``torch.serialization.add_safe_globals`` or the ``safe_globals``
  context). Anything else is refused by name before it is looked up.

Non-tensor items go through ``torch.load(weights_only=True)`` with the same opcode gate and,
allowed by default, types whose reconstruction runs no user code (:data:`SAFE_ITEM_GLOBALS`:
NumPy arrays, dtypes and scalars, so ``np.random.get_state()``; ``datetime``;
``argparse.Namespace``).
"""

from __future__ import annotations

import argparse
import builtins
import collections
import datetime
import io
import pathlib
import pickle
import pickletools

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

from fsdp_ext._torch import (
    DCP_METADATA_LEGACY_GLOBALS,
    DCP_METADATA_PRIVATE_GLOBALS,
    DcpStorageInfo,
)
from fsdp_ext.checkpoint.manifest import CheckpointIntegrityError, UnsafeCheckpointError

__all__ = ["ALLOWED_OPCODES", "SAFE_ITEM_GLOBALS", "load_metadata", "load_object_safely"]

StorageInfo = DcpStorageInfo

# Every opcode a pickle of DCP metadata or of plain data (protocols 2-5) uses. Not here:
# EXT1/EXT2/EXT4, PERSID/BINPERSID, INST/OBJ, BYTEARRAY8, NEXT_BUFFER, READONLY_BUFFER.
ALLOWED_OPCODES = frozenset(
    {
        "PROTO",
        "FRAME",
        "STOP",
        "MARK",
        "POP",
        "POP_MARK",
        "DUP",
        "NONE",
        "NEWTRUE",
        "NEWFALSE",
        "INT",
        "BININT",
        "BININT1",
        "BININT2",
        "LONG",
        "LONG1",
        "LONG4",
        "FLOAT",
        "BINFLOAT",
        "STRING",
        "BINSTRING",
        "SHORT_BINSTRING",
        "UNICODE",
        "BINUNICODE",
        "SHORT_BINUNICODE",
        "BINUNICODE8",
        "BINBYTES",
        "SHORT_BINBYTES",
        "BINBYTES8",
        "EMPTY_LIST",
        "APPEND",
        "APPENDS",
        "LIST",
        "EMPTY_TUPLE",
        "TUPLE",
        "TUPLE1",
        "TUPLE2",
        "TUPLE3",
        "EMPTY_DICT",
        "DICT",
        "SETITEM",
        "SETITEMS",
        "EMPTY_SET",
        "ADDITEMS",
        "FROZENSET",
        "GLOBAL",
        "STACK_GLOBAL",
        "REDUCE",
        "BUILD",
        "NEWOBJ",
        "NEWOBJ_EX",
        "PUT",
        "BINPUT",
        "LONG_BINPUT",
        "MEMOIZE",
        "GET",
        "BINGET",
        "LONG_BINGET",
    }
)

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
    ALLOWED_GLOBALS.update(DCP_METADATA_LEGACY_GLOBALS)
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


def _numpy_globals() -> list:
    try:
        import numpy as np
    except ImportError:
        return []
    core = getattr(np, "_core", None) or np.core  # numpy 2 / numpy 1
    found = [core.multiarray._reconstruct, core.multiarray.scalar, np.ndarray, np.dtype]
    dtypes = getattr(np, "dtypes", None)
    if dtypes is not None:  # numpy >= 1.25: a class per dtype, pickled with the dtype
        found += [
            getattr(dtypes, name)
            for name in dir(dtypes)
            if name.endswith("DType") and name != "ObjectDType"
        ]
    return found


# Non-tensor items whose reconstruction runs no user code: NumPy builds arrays, dtypes and
# scalars from bytes in its own C code (an object array's elements pass the same gates);
# the rest are plain value types of the standard library.
SAFE_ITEM_GLOBALS: list = [
    *_numpy_globals(),
    datetime.datetime,
    datetime.date,
    datetime.time,
    datetime.timedelta,
    datetime.timezone,
    argparse.Namespace,
]


def _dotted(entry) -> tuple[tuple[str, str], object]:
    """``torch.serialization.get_safe_globals`` entries: an object, or (object, "mod.name")."""
    if isinstance(entry, tuple):
        obj, name = entry
        module, _, qualname = name.rpartition(".")
        return (module, qualname), obj
    return (entry.__module__, entry.__qualname__), entry


def user_allowed_globals() -> dict[tuple[str, str], object]:
    """What the user allowed through ``add_safe_globals`` / the ``safe_globals`` context."""
    return dict(_dotted(e) for e in torch.serialization.get_safe_globals())


def check_opcodes(data: bytes, source: str) -> None:
    """Refuse, before anything runs, a pickle using an opcode outside ALLOWED_OPCODES."""
    try:
        for opcode, _arg, pos in pickletools.genops(data):
            if opcode.name not in ALLOWED_OPCODES:
                raise UnsafeCheckpointError(
                    f"{source}: refuses the pickle opcode {opcode.name} at byte {pos}; DCP "
                    "checkpoints never need it (it can reach objects or code without "
                    "naming a global)"
                )
    except UnsafeCheckpointError:
        raise
    except Exception as exc:  # truncated or garbled: the load below names the damage
        raise CheckpointIntegrityError(
            f"{source}: not a readable pickle ({type(exc).__name__}: {exc})"
        ) from exc


def _allow_call(module: str, name: str) -> str:
    return f"torch.serialization.add_safe_globals([{module}.{name}])"


class RestrictedUnpickler(pickle.Unpickler):
    """An unpickler whose ``find_class`` knows only ``ALLOWED_GLOBALS`` and the user's
    ``torch.serialization`` safe globals. Use it through :func:`load_metadata`, which checks
    the opcodes first."""

    def __init__(self, file, source: str):
        super().__init__(file)
        self.source = source
        self._user = user_allowed_globals()

    def find_class(self, module: str, name: str):
        found = ALLOWED_GLOBALS.get((module, name))
        if found is None:
            found = self._user.get((module, name))
        if found is None:
            raise UnsafeCheckpointError(
                f"{self.source}: refuses to load the pickle global {module}.{name}; DCP "
                "metadata holds only DCP metadata classes, torch sizes/dtypes and builtins. "
                f"If you trust this checkpoint, allow it: {_allow_call(module, name)}"
            )
        return found


def load_metadata(data: bytes, source: str):
    """Unpickle ``.metadata`` bytes: opcodes checked, then :class:`RestrictedUnpickler`;
    then its structure checked."""
    check_opcodes(data, source)
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


def load_object_safely(data: bytes, what: str):
    """A non-tensor item: ``torch.load(weights_only=True)`` plus :data:`SAFE_ITEM_GLOBALS`,
    after the opcode check (the item is a zip holding ``data.pkl``, or a legacy pickle).
    A refusal names the global and the call that allows it."""
    for pickled in _item_pickles(data):
        check_opcodes(pickled, what)
    try:
        with torch.serialization.safe_globals(SAFE_ITEM_GLOBALS):
            return torch.load(io.BytesIO(data), weights_only=True)
    except Exception as exc:
        hint = ""
        try:
            with torch.serialization.safe_globals(SAFE_ITEM_GLOBALS):
                allowed = {".".join(k) for k in user_allowed_globals()}
            unsafe = [
                g
                for g in torch.serialization.get_unsafe_globals_in_checkpoint(io.BytesIO(data))
                if g not in allowed
            ]
        except Exception:
            unsafe = []
        if unsafe:
            module, _, name = unsafe[0].rpartition(".")
            hint = (
                f"the pickle global {unsafe[0]}; if you trust this checkpoint, allow it: "
                f"{_allow_call(module, name)}"
            )
        else:
            first = str(exc).splitlines()[0] if str(exc) else ""
            hint = f"({type(exc).__name__}: {first})"
        raise UnsafeCheckpointError(
            f"{what}: refused to unpickle a non-tensor item outside the weights_only "
            f"allowlist: {hint}"
        ) from exc


def _item_pickles(data: bytes) -> list[bytes]:
    """The pickle streams ``torch.load`` would run for an item: each ``.pkl`` record of a
    torch.save zip, or the bytes themselves (the legacy format)."""
    import zipfile

    buffer = io.BytesIO(data)
    if not zipfile.is_zipfile(buffer):
        return [data]
    try:
        with zipfile.ZipFile(buffer) as archive:
            return [archive.read(n) for n in archive.namelist() if n.endswith(".pkl")]
    except (zipfile.BadZipFile, OSError, ValueError):
        return []  # torch.load reports the damage


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


_TENSOR_PROPERTIES = (
    TensorProperties,
    *(cls for cls in DCP_METADATA_LEGACY_GLOBALS.values() if cls.__name__ == "TensorProperties"),
)


def _check_tensor(entry, fqn: str, refuse) -> None:
    try:
        dtype, size, chunks = entry.properties.dtype, entry.size, entry.chunks
    except AttributeError as exc:
        refuse(f"tensor {fqn!r} is missing fields ({exc})")
    if not isinstance(entry.properties, _TENSOR_PROPERTIES) or not isinstance(dtype, torch.dtype):
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
