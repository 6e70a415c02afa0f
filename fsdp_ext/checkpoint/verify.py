"""Check a checkpoint without loading it: completeness, sizes, checksums, who wrote what."""

from __future__ import annotations

import json
import math
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from fsdp_ext.checkpoint.manifest import (
    MANIFEST_NAME,
    MARKER,
    METADATA_NAME,
    NO_CHECKSUM,
    PLAN_NAME,
    CheckpointIntegrityError,
    FileRecord,
    UnsafeCheckpointError,
    check_record,
    checksum_file,
    read_manifest,
)
from fsdp_ext.checkpoint.unpickler import load_metadata
from fsdp_ext.checkpoint.writer import rank_done_name, staging_prefix


@dataclass
class CheckpointReport:
    """``ok`` when complete and every checksum matches; ``problems`` has one line each."""

    path: str
    problems: list[str] = field(default_factory=list)
    files: dict[str, FileRecord] = field(default_factory=dict)
    bytes_per_rank: dict[int, int] = field(default_factory=dict)
    tensors: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems

    def summary(self) -> str:
        total = sum(self.bytes_per_rank.values())
        state = "ok" if self.ok else f"{len(self.problems)} problem(s)"
        return (
            f"{self.path}: {state}; {len(self.files)} files, {total} bytes, "
            f"{self.tensors} tensors, {len(self.bytes_per_rank)} ranks"
        )

    def table(self) -> str:
        lines = ["rank  bytes"]
        lines += [f"{r:4d}  {b}" for r, b in sorted(self.bytes_per_rank.items())]
        lines.append("file  rank  bytes  layers")
        for name, rec in sorted(self.files.items()):
            lines.append(f"{name}  {rec.rank}  {rec.size}  {','.join(rec.layers) or '-'}")
        return "\n".join(lines)


def verify_checkpoint(path) -> CheckpointReport:
    """Verify the checkpoint directory ``path``; never raises for a bad checkpoint."""
    root = Path(path)
    report = CheckpointReport(str(root))
    if not root.is_dir():
        report.problems.append(f"{root}: no such checkpoint directory")
        for partial in sorted(root.parent.glob(staging_prefix(root) + "*")):
            _report_unfinished(partial, report)
        return report
    if (root / PLAN_NAME).exists():
        _report_unfinished(root, report)
        return report
    try:
        manifest = read_manifest(root)
    except CheckpointIntegrityError as exc:
        report.problems.append(str(exc))
        return report
    meta_path = root / METADATA_NAME
    if manifest is None:
        report.problems.append(
            f"{root / MANIFEST_NAME}: missing; sizes and checksums cannot be verified"
        )
    else:
        report.files = manifest.files
        for rec in manifest.files.values():
            report.bytes_per_rank[rec.rank] = report.bytes_per_rank.get(rec.rank, 0) + rec.size
            _check_file(root / rec.name, rec, report, manifest.checksum)
        if meta_path.is_file() and not _check_file(
            meta_path, manifest.metadata, report, manifest.checksum
        ):
            return report  # altered metadata: do not even parse it
    if not meta_path.is_file():
        report.problems.append(f"{meta_path}: missing (the save did not finish, or it was deleted)")
        return report
    try:
        metadata = load_metadata(meta_path.read_bytes(), str(meta_path))
    except (CheckpointIntegrityError, UnsafeCheckpointError) as exc:
        report.problems.append(str(exc))
        return report
    if manifest is None and MARKER in (getattr(metadata.storage_meta, "modules", None) or []):
        report.problems[-1] += f" ({METADATA_NAME} says it was written with one)"
    _check_coverage(root, metadata, manifest, report)
    return report


def _check_file(path: Path, record: FileRecord, report: CheckpointReport, kind: str) -> bool:
    if not path.is_file():
        report.problems.append(f"{path}: missing ({record.size} bytes, rank {record.rank})")
        return False
    size, checksum = checksum_file(path)
    try:
        check_record(str(path), record, size, None if kind == NO_CHECKSUM else checksum)
    except CheckpointIntegrityError as exc:
        report.problems.append(str(exc))
        return False
    return True


def _check_coverage(root: Path, metadata, manifest, report: CheckpointReport) -> None:
    """Every tensor's chunks cover it, and every chunk is stored in a listed file."""
    stored = {(k.fqn, tuple(k.offset or ())): v for k, v in metadata.storage_data.items()}
    for fqn, md in metadata.state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata):
            if (fqn, ()) not in stored:
                report.problems.append(f"{root}: item {fqn} has no stored data")
            continue
        report.tensors += 1
        volume = sum(math.prod(c.sizes) for c in md.chunks)
        if volume != math.prod(md.size):
            report.problems.append(
                f"{root}: tensor {fqn} chunks cover {volume} of {math.prod(md.size)} elements"
            )
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


def _report_unfinished(partial: Path, report: CheckpointReport) -> None:
    """Name what a save that never published is missing: ranks, files, metadata."""
    report.problems.append(f"{partial}: an unfinished save (never published)")
    plan_path = partial / PLAN_NAME
    if not plan_path.is_file():
        return
    expected = json.loads(plan_path.read_text())["files"]
    by_rank: dict[int, list[str]] = defaultdict(list)
    for name, info in sorted(expected.items()):
        by_rank[info["rank"]].append(name)
    for rank, names in sorted(by_rank.items()):
        if not (partial / rank_done_name(rank)).is_file():
            report.problems.append(
                f"{partial / rank_done_name(rank)}: missing: rank {rank} did not finish writing "
                f"{', '.join(names)}"
            )
    for name, info in sorted(expected.items()):
        if not (partial / name).is_file():
            report.problems.append(f"{partial / name}: missing (rank {info['rank']})")
    for name in (METADATA_NAME, MANIFEST_NAME):
        if not (partial / name).is_file():
            report.problems.append(f"{partial / name}: missing (written after every rank finished)")
