"""Check a checkpoint without loading it: completeness, sizes, checksums, who wrote what.

``verify_checkpoint`` never raises for a bad checkpoint: every problem becomes one line of
the report naming the file. For a path that links to a version directory (how
``SpreadFileSystemWriter`` publishes) it says which version the path loads, and describes
the other versions beside it: the previous checkpoint a killed save had not yet removed, a
complete save killed before its publish, an unfinished one.
"""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path

from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from fsdp_ext.checkpoint.blob_verify import verify_blob_checkpoint
from fsdp_ext.checkpoint.location import is_object_store, posix_storage
from fsdp_ext.checkpoint.lock import LockOwner, lock_path
from fsdp_ext.checkpoint.manifest import (
    MANIFEST_NAME,
    MARKER,
    METADATA_NAME,
    NO_CHECKSUM,
    PLAN_NAME,
    CheckpointIntegrityError,
    FileRecord,
    Manifest,
    UnsafeCheckpointError,
    check_record,
    checksum_stream,
    parse_manifest,
    read_plan_record,
)
from fsdp_ext.checkpoint.report import CheckpointReport
from fsdp_ext.checkpoint.storage import DIRECTORY, FILE, LINK, MISSING, CheckpointStorage
from fsdp_ext.checkpoint.unpickler import load_metadata
from fsdp_ext.checkpoint.versions import Version, versions
from fsdp_ext.checkpoint.writer import rank_done_name


def verify_checkpoint(
    path, *, require_checksums: bool = True, fs: CheckpointStorage | None = None
) -> CheckpointReport:
    """Verify the checkpoint at ``path``; never raises for a bad checkpoint.

    ``require_checksums``: a manifest recording no checksums (``checksums=False``) is a
    problem, because a changed byte would pass; with False, sizes alone are checked.
    ``fs``: where it is stored (default: the local filesystem). An ``s3://`` location is
    checked through its catalog (``blob_verify.py``): every published step.
    """
    if is_object_store(path):
        return verify_blob_checkpoint(path)
    root = Path(path)
    report = CheckpointReport(str(root))
    try:
        _verify(posix_storage(fs), root, report, require_checksums)
    except Exception as exc:  # an unforeseen failure still gives a report, never a traceback
        report.problems.append(f"{root}: could not be verified ({type(exc).__name__}: {exc})")
    return report


def _verify(
    fs: CheckpointStorage, root: Path, report: CheckpointReport, require_checksums: bool
) -> None:
    directory = _resolve(fs, root, report)
    manifest = None
    if directory is not None:
        manifest = _check_directory(fs, directory, report, require_checksums)
    _describe_neighbours(fs, root, report, manifest)


def _resolve(fs: CheckpointStorage, root: Path, report: CheckpointReport) -> Path | None:
    """The directory to check: the path itself, or the version it links to."""
    kind = fs.kind(root)
    if kind == LINK:
        name = fs.readlink(root)
        report.version = name
        directory = root.parent / name
        if fs.kind(directory) != DIRECTORY:
            report.problems.append(f"{root}: links to {name}, which is not a directory")
            return None
        return directory
    if kind == MISSING:
        report.problems.append(f"{root}: no such checkpoint directory")
        return None
    if kind != DIRECTORY:
        report.problems.append(f"{root}: is a {kind}, not a checkpoint directory")
        return None
    return root


def _check_directory(
    fs: CheckpointStorage, directory: Path, report: CheckpointReport, require: bool
) -> Manifest | None:
    manifest_path = directory / MANIFEST_NAME
    if not _is_file(fs, manifest_path) and _is_file(fs, directory / PLAN_NAME):
        _report_unfinished(fs, directory, report.problems)
        return None
    try:
        manifest = None
        if _is_file(fs, manifest_path):
            manifest = parse_manifest(fs.read_bytes(manifest_path), str(manifest_path))
    except CheckpointIntegrityError as exc:
        report.problems.append(str(exc))
        return None
    meta_path = directory / METADATA_NAME
    if manifest is None:
        report.problems.append(
            f"{directory / MANIFEST_NAME}: missing; sizes and checksums cannot be verified"
        )
    else:
        report.save_id = manifest.save_id or None
        if manifest.checksum == NO_CHECKSUM and require:
            report.problems.append(
                f"{directory / MANIFEST_NAME}: records no checksums (saved with checksums=False, "
                "or the field was altered); only sizes were checked"
            )
        report.files = manifest.files
        for rec in manifest.files.values():
            report.bytes_per_rank[rec.rank] = report.bytes_per_rank.get(rec.rank, 0) + rec.size
            _check_file(fs, directory / rec.name, rec, report, manifest.checksum)
        if _is_file(fs, meta_path) and not _check_file(
            fs, meta_path, manifest.metadata, report, manifest.checksum
        ):
            return manifest  # altered metadata: do not even parse it
    if not _is_file(fs, meta_path):
        report.problems.append(f"{meta_path}: missing (the save did not finish, or it was deleted)")
        return manifest
    try:
        metadata = load_metadata(fs.read_bytes(meta_path), str(meta_path))
    except (CheckpointIntegrityError, UnsafeCheckpointError) as exc:
        report.problems.append(str(exc))
        return manifest
    if manifest is None and MARKER in (getattr(metadata.storage_meta, "modules", None) or []):
        report.problems[-1] += f" ({METADATA_NAME} says it was written with one)"
    _check_coverage(directory, metadata, manifest, report)
    return manifest


def _is_file(fs: CheckpointStorage, path: Path) -> bool:
    return fs.kind(path) == FILE


def _check_file(
    fs: CheckpointStorage, path: Path, record: FileRecord, report: CheckpointReport, kind: str
) -> bool:
    if not _is_file(fs, path):
        report.problems.append(f"{path}: missing ({record.size} bytes, rank {record.rank})")
        return False
    with fs.open_read(path) as stream:
        size, checksum = checksum_stream(stream)
    try:
        check_record(str(path), record, size, None if kind == NO_CHECKSUM else checksum)
    except CheckpointIntegrityError as exc:
        report.problems.append(str(exc))
        return False
    return True


def _check_coverage(root: Path, metadata, manifest, report: CheckpointReport) -> None:
    """Every tensor's chunks tile it exactly, and every chunk is stored in a listed file."""
    stored = {(k.fqn, tuple(k.offset or ())): v for k, v in metadata.storage_data.items()}
    for fqn, md in metadata.state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata):
            if (fqn, ()) not in stored:
                report.problems.append(f"{root}: item {fqn} has no stored data")
            continue
        report.tensors += 1
        problem = _tiling_problem(md.size, md.chunks)
        if problem:
            report.problems.append(f"{root}: tensor {fqn} {problem}")
        for chunk in md.chunks:
            if (fqn, tuple(chunk.offsets)) not in stored:
                report.problems.append(
                    f"{root}: tensor {fqn} chunk at {tuple(chunk.offsets)} has no stored data"
                )
    if manifest is not None:
        missing = sorted({v.relative_path for v in stored.values()} - set(manifest.files))
        report.problems += [
            f"{root / n}: used by {METADATA_NAME}, not in {MANIFEST_NAME}" for n in missing
        ]
        for (fqn, offset), info in sorted(stored.items()):
            record = manifest.files.get(info.relative_path)
            end = info.offset + info.length
            if record is not None and (info.offset < 0 or info.length < 0 or end > record.size):
                report.problems.append(
                    f"{root / info.relative_path}: {METADATA_NAME} puts item {fqn} "
                    f"{offset} at bytes {info.offset}..{end}, beyond the file's "
                    f"{record.size} bytes"
                )


def _tiling_problem(size, chunks) -> str | None:
    """Why ``chunks`` do not cover a tensor of ``size`` exactly once, or None.

    Inside the bounds, pairwise disjoint and summing to the tensor's volume is an exact
    cover. A load would otherwise leave elements as they were, silently (DCP copies only
    what the chunks hold).
    """
    for c in chunks:
        if any(o + n > d for o, n, d in zip(c.offsets, c.sizes, size, strict=True)):
            return f"chunk at {tuple(c.offsets)} of {tuple(c.sizes)} lies outside {tuple(size)}"
    volume = sum(math.prod(c.sizes) for c in chunks)
    if volume != math.prod(size):
        return f"chunks cover {volume} of {math.prod(size)} elements"
    ordered = sorted(chunks, key=lambda c: tuple(c.offsets))
    for i, a in enumerate(ordered):
        for b in ordered[i + 1 :]:
            if size and b.offsets[0] >= a.offsets[0] + a.sizes[0]:
                break  # sorted by dim-0 offset: no later chunk meets ``a`` either
            if all(
                max(ao, bo) < min(ao + an, bo + bn)
                for ao, an, bo, bn in zip(a.offsets, a.sizes, b.offsets, b.sizes, strict=True)
            ):
                return f"chunks at {tuple(a.offsets)} and {tuple(b.offsets)} overlap"
    return None


def _describe_neighbours(
    fs: CheckpointStorage, root: Path, report: CheckpointReport, manifest: Manifest | None
) -> None:
    """Notes on the other versions of this path, and on a lock a save holds on it."""
    replaced = manifest.replaces if manifest is not None else None
    # what the path is now: the version it links to, or (a directory) the save it holds
    current = report.version or (f"save {report.save_id}" if report.save_id else None)
    for version in versions(fs, root):
        if version.name == report.version:
            continue
        report.notes.append(_describe(root, version, current, replaced))
        if not version.complete:
            _report_unfinished(fs, root.parent / version.name, report.notes, header=False)
    lock = lock_path(root)
    if fs.kind(lock) == LINK:
        owner = LockOwner.decode(fs.readlink(lock))
        if owner is None:
            report.notes.append(f"{lock}: a lock file this writer did not make")
        else:
            stale = owner.stale_reason()
            state = f"stale: {stale}" if stale else "a save may be running"
            report.notes.append(f"{lock}: held by {owner.describe()} ({state})")


def _describe(root: Path, version: Version, current: str | None, replaced: str | None) -> str:
    where = root.parent / version.name
    later = "; the next save to this path removes it"
    if not version.complete:
        return f"{where}: an unfinished save ({version.save_id}), never published{later}"
    if version.name == replaced:
        return (
            f"{where}: the previous checkpoint (save {version.save_id}), replaced by "
            f"{current}; the save that replaced it stopped before removing it{later}"
        )
    # a swap publishes a version whose manifest names itself as where the previous goes
    if current is None or version.replaces in (current, version.name):
        if current is None:
            now = "was never created"
        else:
            now = f"still {'links to' if _is_link_target(current) else 'is'} {current}"
        return (
            f"{where}: a complete save ({version.save_id}) that was never published: it "
            f"stopped before its publish, so {root.name} {now}{later}"
        )
    return f"{where}: an older complete version (save {version.save_id}){later}"


def _is_link_target(current: str) -> bool:
    return not current.startswith("save ")


def _report_unfinished(
    fs: CheckpointStorage, partial: Path, lines: list[str], header: bool = True
) -> None:
    """Name what a save that never published is missing: ranks, files, metadata."""
    if header:
        lines.append(f"{partial}: an unfinished save (never published)")
    plan_path = partial / PLAN_NAME
    if not _is_file(fs, plan_path):
        return
    try:
        expected = read_plan_record(fs.read_bytes(plan_path), str(plan_path))["files"]
    except CheckpointIntegrityError as exc:
        lines.append(str(exc))
        return
    by_rank: dict[int, list[str]] = defaultdict(list)
    for name, info in sorted(expected.items()):
        by_rank[info["rank"]].append(name)
    for rank, names in sorted(by_rank.items()):
        if not _is_file(fs, partial / rank_done_name(rank)):
            lines.append(
                f"{partial / rank_done_name(rank)}: missing: rank {rank} did not finish writing "
                f"{', '.join(names)}"
            )
    for rank, names in sorted(by_rank.items()):
        lines += [
            f"{partial / n}: missing (rank {rank})" for n in names if not _exists(fs, partial, n)
        ]
    for name in (METADATA_NAME, MANIFEST_NAME):
        if not _is_file(fs, partial / name):
            lines.append(f"{partial / name}: missing (written after every rank finished)")


def _exists(fs: CheckpointStorage, directory: Path, name: str) -> bool:
    return "/" not in name and name not in ("", ".", "..") and _is_file(fs, directory / name)
