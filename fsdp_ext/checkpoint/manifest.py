"""The manifest: every file of a checkpoint with its size and checksum, as plain JSON.

It is JSON so that reading it runs no code. The checksum is zlib's CRC-32: it catches any
flipped byte or torn write, is computed while the bytes stream out (no second pass), and at
~3.5 GB/s per core it costs a few percent of a save (measured in docs/checkpoint.md); a
cryptographic hash (blake2b ~0.75 GB/s here) would protect against nobody extra, because an
attacker who can rewrite a data file can rewrite the manifest too.
"""

from __future__ import annotations

import json
import os
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path

MANIFEST_NAME = ".manifest.json"
METADATA_NAME = ".metadata"
PLAN_NAME = ".plan.json"  # written at the start of a save: the files every rank will write
CHECKSUM = "crc32"
NO_CHECKSUM = "none"  # SpreadFileSystemWriter(checksums=False): sizes only
FORMAT = "fsdp_ext.checkpoint/1"
# Recorded in Metadata.storage_meta.modules: a checkpoint that says this must have a manifest.
MARKER = "fsdp_ext.checkpoint"


class CheckpointIntegrityError(RuntimeError):
    """A checkpoint file is missing, truncated or altered; the message names the file."""


class UnsafeCheckpointError(RuntimeError):
    """A checkpoint asked to run code on load (a pickle global outside the allowed set)."""


class CheckpointPathError(RuntimeError):
    """The checkpoint path holds something the writer will not replace; nothing was written."""


class CheckpointBusyError(CheckpointPathError):
    """Another save holds the path's lock; the message names it."""


class CheckpointSpaceError(OSError):
    """The device ran out of space during a save; the message says how much was needed."""


@dataclass
class FileRecord:
    name: str
    rank: int
    size: int
    checksum: str
    layers: list[str] = field(default_factory=list)
    items: int = 0


@dataclass
class Manifest:
    files: dict[str, FileRecord]
    metadata: FileRecord
    world_size: int
    checksum: str = CHECKSUM
    format: str = FORMAT
    # the overwrite protocol's records (absent from checkpoints written before it)
    target: str = ""  # the name of the path this version was published at
    save_id: str = ""
    replaces: str | None = None  # the version the path pointed to when this save began

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str, source: str) -> Manifest:
        """Parse and type-check a manifest; anything off raises naming ``source``."""
        try:
            raw = json.loads(text)
            if not isinstance(raw, dict):
                raise TypeError(f"a {type(raw).__name__}, not an object")
            if raw.get("format") != FORMAT or raw.get("checksum") not in (CHECKSUM, NO_CHECKSUM):
                raise ValueError(f"format {raw.get('format')!r} / checksum {raw.get('checksum')!r}")
            if not isinstance(raw["files"], dict):
                raise TypeError("files is not an object")
            files = {}
            for name, rec in raw["files"].items():
                record = _file_record(rec)
                if record.name != name or not _plain_name(name):
                    raise ValueError(f"file entry {name!r} names {record.name!r}")
                files[name] = record
            replaces = raw.get("replaces")
            if replaces is not None and not isinstance(replaces, str):
                raise TypeError(f"replaces is {replaces!r}")
            return cls(
                files=files,
                metadata=_file_record(raw["metadata"]),
                world_size=_count(raw["world_size"], "world_size"),
                checksum=raw["checksum"],
                target=_string(raw.get("target", ""), "target"),
                save_id=_string(raw.get("save_id", ""), "save_id"),
                replaces=replaces,
            )
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointIntegrityError(
                f"{source}: not a readable manifest ({type(exc).__name__}: {exc})"
            ) from exc


def _count(value, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < -1:
        raise TypeError(f"{what} is {value!r}, not a count")
    return value


def _string(value, what: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{what} is {value!r}, not a string")
    return value


def _plain_name(name: str) -> bool:
    """A file directly in the checkpoint directory (no path that leads elsewhere)."""
    return bool(name) and name not in (".", "..") and "/" not in name and "\0" not in name


def _file_record(raw) -> FileRecord:
    if not isinstance(raw, dict):
        raise TypeError(f"a file record is {raw!r}")
    record = FileRecord(**raw)
    layers = record.layers
    if not isinstance(layers, list) or not all(isinstance(x, str) for x in layers):
        raise TypeError(f"{record.name!r}: layers is {layers!r}")
    _string(record.name, "a file name")
    _string(record.checksum, f"{record.name!r}: checksum")
    _count(record.rank, f"{record.name!r}: rank")
    _count(record.items, f"{record.name!r}: items")
    if _count(record.size, f"{record.name!r}: size") < 0:
        raise ValueError(f"{record.name!r}: size {record.size}")
    return record


def crc32_hex(value: int) -> str:
    return f"{value & 0xFFFFFFFF:08x}"


def checksum_bytes(data) -> str:
    return crc32_hex(zlib.crc32(data))


def checksum_file(path: str | os.PathLike, block: int = 16 << 20) -> tuple[int, str]:
    """Size and CRC-32 of a file on disk, read in blocks."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(block):
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
    return size, crc32_hex(crc)


def read_manifest(directory: str | os.PathLike) -> Manifest | None:
    path = Path(directory) / MANIFEST_NAME
    if not path.is_file():
        return None
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CheckpointIntegrityError(
            f"{path}: not a readable manifest (not UTF-8: {exc})"
        ) from exc
    return Manifest.from_json(text, str(path))


def check_record(path: str, record: FileRecord, size: int, checksum: str | None) -> None:
    """Raise naming the file unless its size and checksum are what the manifest says.

    ``checksum=None``: the manifest records none (written with ``checksums=False``).
    """
    if size != record.size:
        raise CheckpointIntegrityError(
            f"{path}: size {size} bytes, the manifest expects {record.size} "
            "(truncated or overwritten)"
        )
    if checksum is not None and checksum != record.checksum:
        raise CheckpointIntegrityError(
            f"{path}: {CHECKSUM} {checksum}, the manifest expects {record.checksum} "
            "(the file was altered or corrupted)"
        )
