"""The manifest: every file of a checkpoint with its size and checksum, as plain JSON.

It is JSON so that reading it runs no code. It vouches for itself too: it carries the CRC-32
of its own canonical body (``manifest_crc32``), and is read strictly (exactly the known keys,
no duplicates, no floats, byte for byte the canonical form), so that a flipped bit anywhere
in it is named rather than read as another file list, rank or ``replaces`` (which decides
what a later cleanup removes). ``.metadata`` is covered by its record in the manifest, and
the plan record of a running save seals itself the same way (:func:`plan_record_bytes`).

The checksum is zlib's CRC-32: it catches any flipped byte or torn write (every error of
up to 32 bits, so every single-bit flip for certain), is computed while the bytes stream
out (no second pass), and costs a few percent of a save (measured in docs/checkpoint.md); a
cryptographic hash (blake2b ~0.75 GB/s here) would protect against nobody extra, because an
attacker who can rewrite a data file can rewrite the manifest too. It is computed by
zlib-ng's ``crc32`` (the same function, vectorised: 6.5 GB/s on one core here against
zlib's 2.2, both without the GIL), else by zlib's: on a host whose cores train, the CRC was
the largest part of a background write's CPU.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import asdict, dataclass, field, fields

try:  # the same CRC-32, three times zlib's speed (the module docstring)
    from zlib_ng.zlib_ng import crc32
except ImportError:  # a platform without its wheel
    from zlib import crc32

MANIFEST_NAME = ".manifest.json"
METADATA_NAME = ".metadata"
PLAN_NAME = ".plan.json"  # written at the start of a save: the files every rank will write
CHECKSUM = "crc32"
NO_CHECKSUM = "none"  # SpreadFileSystemWriter(checksums=False): sizes only
FORMAT = "fsdp_ext.checkpoint/2"
LEGACY_FORMAT = "fsdp_ext.checkpoint/1"  # before the manifest sealed itself: still loads
SELF_CHECKSUM = "manifest_crc32"  # the field that holds the CRC-32 of the rest
PLAN_CHECKSUM = "plan_crc32"
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
        """The canonical, sealed text: the only form :meth:`from_json` accepts."""
        return seal(asdict(self), SELF_CHECKSUM)

    @classmethod
    def from_json(cls, text: str, source: str) -> Manifest:
        """Parse and check a manifest; anything off raises naming ``source``.

        A manifest of format /1 (written before manifests sealed themselves) still loads, so
        that no checkpoint of an earlier release is lost: its files and ``.metadata`` are
        checked by their records as before, only the manifest's own bytes are not covered.
        """
        try:
            if _legacy_format(text):
                warnings.warn(
                    f"{source}: a manifest of format {LEGACY_FORMAT} (an earlier release), "
                    "which does not cover its own bytes; its files are still checked. A new "
                    "save writes the sealed format.",
                    stacklevel=2,
                )
                raw = json.loads(text)
                if not isinstance(raw, dict):
                    raise TypeError(f"a {type(raw).__name__}, not an object")
                raw = {"target": "", "save_id": "", "replaces": None, **raw}
            else:
                raw = unseal(text, SELF_CHECKSUM, _MANIFEST_KEYS)
                if raw["format"] != FORMAT:
                    raise ValueError(f"format {raw['format']!r}")
            if raw["checksum"] not in (CHECKSUM, NO_CHECKSUM):
                raise ValueError(f"checksum {raw['checksum']!r}")
            if not isinstance(raw["files"], dict):
                raise TypeError("files is not an object")
            files = {}
            for name, rec in raw["files"].items():
                record = _file_record(rec)
                if record.name != name or not _plain_name(name):
                    raise ValueError(f"file entry {name!r} names {record.name!r}")
                files[name] = record
            replaces = raw["replaces"]
            if replaces is not None and not isinstance(replaces, str):
                raise TypeError(f"replaces is {replaces!r}")
            return cls(
                files=files,
                metadata=_file_record(raw["metadata"]),
                world_size=_count(raw["world_size"], "world_size"),
                checksum=raw["checksum"],
                format=raw["format"],
                target=_string(raw["target"], "target"),
                save_id=_string(raw["save_id"], "save_id"),
                replaces=replaces,
            )
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointIntegrityError(
                f"{source}: not a readable manifest ({type(exc).__name__}: {exc})"
            ) from exc


def _legacy_format(text: str) -> bool:
    """Whether ``text`` is an unsealed manifest of format /1 (no single flipped bit turns
    the sealed format's name into it: "2" and "1" differ in two bits)."""
    try:
        raw = json.loads(text)
    except ValueError:
        return False
    return isinstance(raw, dict) and raw.get("format") == LEGACY_FORMAT and SELF_CHECKSUM not in raw


_MANIFEST_KEYS = frozenset(f.name for f in fields(Manifest))
_RECORD_KEYS = frozenset(f.name for f in fields(FileRecord))


def canonical_json(value) -> str:
    """The one text a value has: sorted keys, one-space indent, ASCII, a final newline."""
    return json.dumps(value, indent=1, sort_keys=True, ensure_ascii=True) + "\n"


def seal(body: dict, field_name: str) -> str:
    """``body`` as canonical JSON carrying, in ``field_name``, the CRC-32 of the rest."""
    rest = {k: v for k, v in body.items() if k != field_name}
    return canonical_json({**rest, field_name: checksum_bytes(canonical_json(rest).encode())})


def unseal(text: str, field_name: str, keys: frozenset[str]) -> dict:
    """The body of a sealed record, or ValueError/TypeError saying what is off.

    Strict on purpose: any other key set, a duplicate key, a float, or a text that is not
    byte for byte the canonical form is refused, so a flipped bit cannot hide in whitespace,
    an escape or an ignored key; then the CRC-32 covers every value.
    """
    raw = json.loads(
        text,
        object_pairs_hook=_no_duplicates,
        parse_float=_no_float,
        parse_constant=_no_float,
    )
    if not isinstance(raw, dict):
        raise TypeError(f"a {type(raw).__name__}, not an object")
    if set(raw) != keys | {field_name}:
        odd = sorted(set(raw) ^ (keys | {field_name}))
        raise ValueError(f"keys {odd} are unexpected or missing")
    if text != canonical_json(raw):
        raise ValueError("not in canonical form (edited, or a flipped byte)")
    rest = {k: v for k, v in raw.items() if k != field_name}
    found = checksum_bytes(canonical_json(rest).encode())
    if raw[field_name] != found:
        raise ValueError(f"{field_name} {raw[field_name]!r}, the content's is {found!r}")
    return rest


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise ValueError(f"duplicate keys {sorted(k for k, _ in pairs)}")
    return out


def _no_float(text: str):
    raise ValueError(f"a number that is not an integer: {text}")


def plan_record_bytes(record: dict) -> bytes:
    """The plan record of a running save (``.plan.json``), sealed like the manifest."""
    return seal(record, PLAN_CHECKSUM).encode()


def read_plan_record(data: bytes, source: str) -> dict:
    """A plan record's body; a flipped bit raises :class:`CheckpointIntegrityError`."""
    try:
        raw = unseal(data.decode("utf-8"), PLAN_CHECKSUM, _PLAN_KEYS)
        if not isinstance(raw["files"], dict) or not all(
            isinstance(v, dict) and isinstance(v.get("rank"), int) for v in raw["files"].values()
        ):
            raise TypeError("files is not an object of {rank: int, ...} records")
        return raw
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointIntegrityError(
            f"{source}: not a readable plan record ({type(exc).__name__}: {exc})"
        ) from exc


_PLAN_KEYS = frozenset({"target", "save_id", "replaces", "world_size", "files"})


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
    if set(raw) != _RECORD_KEYS:
        raise ValueError(f"a file record's keys are {sorted(raw)}, not {sorted(_RECORD_KEYS)}")
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
    return crc32_hex(crc32(data))


def checksum_stream(stream, block: int = 16 << 20) -> tuple[int, str]:
    """Size and CRC-32 of what ``stream`` holds from where it stands, read in blocks."""
    crc, size = 0, 0
    while chunk := stream.read(block):
        crc = crc32(chunk, crc)
        size += len(chunk)
    return size, crc32_hex(crc)


def parse_manifest(data: bytes, source: str) -> Manifest:
    """A manifest from its bytes; anything off raises naming ``source``."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CheckpointIntegrityError(
            f"{source}: not a readable manifest (not UTF-8: {exc})"
        ) from exc
    return Manifest.from_json(text, source)


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
