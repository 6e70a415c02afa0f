"""A DCP StorageReader for blob stores: a step resolved through the catalog, ranged gets,
sizes and checksums checked, no pickle run.

- The catalog names the step's version prefix; every rank resolves it, and the global plan
  checks they all got the same one (a commit in between could otherwise mix two saves).
- The manifest (sealed JSON) is read first; ``.metadata`` is checked against its record,
  then read by the restricted unpickler (``unpickler.py``).
- Each file's CRC-32 is checked once, by one rank that reads it (``verify_plan.py``): that
  rank gets the file whole. Other ranks get only the byte span their items cover, with one
  ranged get per file, and check its length.
- Non-tensor items pass ``weights_only`` first; tensors load with ``weights_only=True``.
"""

from __future__ import annotations

import dataclasses
import io

import torch
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from fsdp_ext.checkpoint.blob import BlobNotFoundError, BlobStore
from fsdp_ext.checkpoint.catalog import CATALOG_KEY, read_catalog
from fsdp_ext.checkpoint.location import blob_store_for
from fsdp_ext.checkpoint.manifest import (
    MANIFEST_NAME,
    METADATA_NAME,
    NO_CHECKSUM,
    CheckpointIntegrityError,
    Manifest,
    check_record,
    checksum_bytes,
    parse_manifest,
)
from fsdp_ext.checkpoint.unpickler import load_metadata, load_object_safely
from fsdp_ext.checkpoint.verify_plan import assign_checks

__all__ = ["BlobStorageReader", "resolve_step"]


def resolve_step(store: BlobStore, step: int | None) -> tuple[int, str]:
    """(step, version prefix) of ``step`` (None: the newest) in the catalog, or an error
    naming the location and what it holds."""
    catalog, _etag = read_catalog(store)
    if not catalog.steps:
        raise FileNotFoundError(
            f"{store.where(CATALOG_KEY)}: no checkpoint published at {store.location}"
        )
    if step is None:
        step = max(catalog.steps)
    if step not in catalog.steps:
        raise FileNotFoundError(
            f"{store.location}: no step {step} published; steps: {sorted(catalog.steps)}"
        )
    return step, catalog.steps[step]


def read_verified(store: BlobStore, prefix: str) -> tuple[Manifest, Metadata]:
    """A version's manifest and its ``.metadata``, checked; no pickle runs."""
    where = store.where(prefix)
    try:
        manifest = parse_manifest(
            store.get(f"{prefix}/{MANIFEST_NAME}"), f"{where}/{MANIFEST_NAME}"
        )
        data = store.get(f"{prefix}/{METADATA_NAME}")
    except BlobNotFoundError as exc:
        raise CheckpointIntegrityError(f"{exc}: the published version is incomplete") from exc
    checksum = None if manifest.checksum == NO_CHECKSUM else checksum_bytes(data)
    check_record(f"{where}/{METADATA_NAME}", manifest.metadata, len(data), checksum)
    return manifest, load_metadata(data, f"{where}/{METADATA_NAME}")


class BlobStorageReader(StorageReader):
    """Load step ``step`` (None: the newest published) of the blob location ``location``."""

    def __init__(self, location: str, step: int | None = None) -> None:
        super().__init__()
        if step is not None and (not isinstance(step, int) or isinstance(step, bool) or step < 0):
            raise ValueError(f"step must be an int >= 0 or None (the newest), got {step!r}")
        self.location = str(location)
        self.store: BlobStore = blob_store_for(self.location)
        self.step = step
        self.prefix: str | None = None
        self.manifest: Manifest | None = None
        self.storage_data: dict = {}
        self.checks_here: set[str] = set()

    def reset(self, checkpoint_id=None) -> None:
        if checkpoint_id is not None and str(checkpoint_id) != self.location:
            self.location = str(checkpoint_id)
            self.store = blob_store_for(self.location)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return str(checkpoint_id).startswith("s3://")

    def read_metadata(self) -> Metadata:
        self.step, self.prefix = resolve_step(self.store, self.step)
        self.manifest, metadata = read_verified(self.store, self.prefix)
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args, **kwargs):
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        reads: dict[str, int] = {}
        for item in plan.items:
            info = self.storage_data[item.storage_index]
            reads[info.relative_path] = reads.get(info.relative_path, 0) + info.length
        return dataclasses.replace(plan, storage_data=(self.prefix, reads))

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        seen = {p.storage_data[0] for p in plans}
        if len(seen) > 1:
            raise CheckpointIntegrityError(
                f"{self.location}: the ranks resolved step {self.step} to different versions "
                f"({sorted(seen)}): a save published it during the load; load again"
            )
        manifest = self.manifest
        assert manifest is not None
        checks = assign_checks(
            [p.storage_data[1] for p in plans],
            {name: rec.size for name, rec in manifest.files.items()},
            {name: rec.rank for name, rec in manifest.files.items()},
        )
        return [dataclasses.replace(p, storage_data=c) for p, c in zip(plans, checks, strict=True)]

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        self.checks_here = set(plan.storage_data or ())
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            name = self.storage_data[item.storage_index].relative_path
            per_file.setdefault(name, []).append(item)
        for name, items in per_file.items():
            base, data = self._fetch(name, items)
            for item in items:
                info = self.storage_data[item.storage_index]
                raw = data[info.offset - base : info.offset - base + info.length]
                self._load_item(name, item, raw, planner)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _fetch(self, name: str, items: list[ReadItem]) -> tuple[int, memoryview]:
        """(offset of the first byte, the bytes): the whole file when this rank checks it,
        else one ranged get of the span the items cover."""
        assert self.manifest is not None and self.prefix is not None
        record = self.manifest.files.get(name)
        where = self.store.where(f"{self.prefix}/{name}")
        if record is None:
            raise CheckpointIntegrityError(f"{where}: not in the manifest")
        key = f"{self.prefix}/{name}"
        try:
            if name in self.checks_here:
                data = self.store.get(key)
                checksum = None if self.manifest.checksum == NO_CHECKSUM else checksum_bytes(data)
                check_record(where, record, len(data), checksum)
                return 0, memoryview(data)
            infos = [self.storage_data[i.storage_index] for i in items]
            start = min(i.offset for i in infos)
            end = max(i.offset + i.length for i in infos)
            if end > record.size:
                raise CheckpointIntegrityError(
                    f"{where}: items reach byte {end}, the manifest says the file has {record.size}"
                )
            data = self.store.get(key, start, end)
        except BlobNotFoundError as exc:
            raise CheckpointIntegrityError(f"{where}: missing (the manifest lists it)") from exc
        if len(data) != end - start:
            raise CheckpointIntegrityError(
                f"{where}: {len(data)} bytes at {start}, expected {end - start} (truncated)"
            )
        return start, memoryview(data)

    def _load_item(self, name: str, item: ReadItem, raw: memoryview, planner: LoadPlanner):
        where = f"{self.store.where(f'{self.prefix}/{name}')}: item {item.dest_index.fqn}"
        if item.type == LoadItemType.BYTE_IO:
            data = bytes(raw)
            load_object_safely(data, where)  # refuses a pickle outside weights_only
            planner.load_bytes(item, io.BytesIO(data))
            return
        try:
            tensor = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
        except Exception as exc:
            raise CheckpointIntegrityError(
                f"{where}: not a readable tensor ({type(exc).__name__}: {exc})"
            ) from exc
        for dim, (offset, length) in enumerate(
            zip(item.storage_offsets, item.lengths, strict=True)
        ):
            tensor = tensor.narrow(dim, offset, length)
        target = planner.resolve_tensor(item).detach()
        if target.size() != tensor.size():
            raise CheckpointIntegrityError(
                f"{where}: stored shape {tuple(tensor.shape)}, expected {tuple(target.shape)}"
            )
        target.copy_(tensor)
        planner.commit_tensor(item, target)
