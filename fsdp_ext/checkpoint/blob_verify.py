"""Check the checkpoints of a blob location (S3) without loading them.

Never raises for a bad checkpoint: every problem is one line naming the object (the
catalog, a manifest, a ``.metadata``, a data file). Checks every published step (or one),
and notes the objects of versions no step names (a save killed before its commit, or a
version replaced by one killed before its cleanup): the owner's next save deletes them.
"""

from __future__ import annotations

from fsdp_ext.checkpoint.blob import BlobError, BlobNotFoundError, BlobStore
from fsdp_ext.checkpoint.blob_reader import read_verified
from fsdp_ext.checkpoint.catalog import CATALOG_KEY, read_catalog, version_prefix_of
from fsdp_ext.checkpoint.location import blob_store_for
from fsdp_ext.checkpoint.manifest import (
    NO_CHECKSUM,
    CheckpointIntegrityError,
    UnsafeCheckpointError,
    check_record,
    checksum_bytes,
)
from fsdp_ext.checkpoint.report import CheckpointReport

__all__ = ["verify_blob_checkpoint"]


def verify_blob_checkpoint(
    location: str, *, step: int | None = None, store: BlobStore | None = None
) -> CheckpointReport:
    """Verify every published step of ``location`` (or only ``step``)."""
    report = CheckpointReport(str(location))
    try:
        _verify(store if store is not None else blob_store_for(location), step, report)
    except (BlobError, OSError) as exc:
        report.problems.append(f"{location}: could not be verified ({exc})")
    except Exception as exc:  # an unforeseen failure still gives a report, never a traceback
        report.problems.append(f"{location}: could not be verified ({type(exc).__name__}: {exc})")
    return report


def _verify(store: BlobStore, step: int | None, report: CheckpointReport) -> None:
    try:
        catalog, _etag = read_catalog(store)
    except CheckpointIntegrityError as exc:
        report.problems.append(str(exc))
        return
    if store.head(CATALOG_KEY) is None:
        report.problems.append(f"{store.where(CATALOG_KEY)}: missing; no checkpoint published")
        return
    steps = sorted(catalog.steps) if step is None else [step]
    if step is not None and step not in catalog.steps:
        report.problems.append(f"{store.location}: no step {step}; steps: {sorted(catalog.steps)}")
        return
    for s in steps:
        _check_version(store, catalog.steps[s], report)
    report.version = catalog.steps[steps[-1]] if steps else None
    if step is None:
        live = set(catalog.steps.values())
        dead = sorted(
            {p for k in store.list("step-") if (p := version_prefix_of(k)) and p not in live}
        )
        for prefix in dead:
            report.notes.append(
                f"{store.where(prefix)}: a version no step names (a save killed before its "
                "commit, or one replaced); the next save deletes it"
            )


def _check_version(store: BlobStore, prefix: str, report: CheckpointReport) -> None:
    try:
        manifest, metadata = read_verified(store, prefix)
    except (CheckpointIntegrityError, UnsafeCheckpointError) as exc:
        report.problems.append(str(exc))
        return
    report.save_id = manifest.save_id or None
    report.tensors += len(metadata.state_dict_metadata)
    for rec in manifest.files.values():
        name = f"{prefix}/{rec.name}"
        report.files[name] = rec
        report.bytes_per_rank[rec.rank] = report.bytes_per_rank.get(rec.rank, 0) + rec.size
        try:
            data = store.get(name)
        except BlobNotFoundError:
            report.problems.append(f"{store.where(name)}: missing (the manifest lists it)")
            continue
        checksum = None if manifest.checksum == NO_CHECKSUM else checksum_bytes(data)
        try:
            check_record(store.where(name), rec, len(data), checksum)
        except CheckpointIntegrityError as exc:
            report.problems.append(str(exc))
