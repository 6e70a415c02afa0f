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

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str, source: str) -> Manifest:
        try:
            raw = json.loads(text)
            if raw.get("format") != FORMAT or raw.get("checksum") not in (CHECKSUM, NO_CHECKSUM):
                raise ValueError(f"format {raw.get('format')!r} / checksum {raw.get('checksum')!r}")
            return cls(
                files={k: FileRecord(**v) for k, v in raw["files"].items()},
                metadata=FileRecord(**raw["metadata"]),
                world_size=int(raw["world_size"]),
                checksum=raw["checksum"],
            )
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointIntegrityError(f"{source}: not a readable manifest ({exc})") from exc


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
    return Manifest.from_json(path.read_text(), str(path))


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
