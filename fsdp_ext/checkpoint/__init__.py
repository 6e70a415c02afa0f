"""DCP checkpoint I/O: spread replicated writes, per-layer files, atomic publish, verified
loads, and the storage they go through.

Everything is used through the stock ``dcp.save`` / ``dcp.async_save`` / ``dcp.load`` calls.
A training run's life around them (save / prune / resume, owning the output directory,
in-memory snapshots) is ``fsdp_ext.job``, which imports this room and never the reverse.
"""

from fsdp_ext.checkpoint.blob import (
    BlobAccessError,
    BlobChangedError,
    BlobConditionError,
    BlobError,
    BlobExistsError,
    BlobInfo,
    BlobNotFoundError,
    BlobStore,
)
from fsdp_ext.checkpoint.blob_reader import BlobStorageReader
from fsdp_ext.checkpoint.blob_writer import BlobStorageWriter
from fsdp_ext.checkpoint.export import ExportConfig, ExportReport, export_safetensors
from fsdp_ext.checkpoint.fence import DirectoryFencedError
from fsdp_ext.checkpoint.fs import LocalStorage
from fsdp_ext.checkpoint.layers import default_layer_key
from fsdp_ext.checkpoint.location import blob_store_for, is_object_store
from fsdp_ext.checkpoint.lock import (
    BEATS_PER_LEASE,
    LEASE_ENV,
    MIN_LEASE_S,
    RUN_ID_ENV,
    CheckpointPrunedError,
    check_lease,
    read_lease,
    unlock,
)
from fsdp_ext.checkpoint.manifest import (
    CheckpointBusyError,
    CheckpointIntegrityError,
    CheckpointPathError,
    CheckpointSpaceError,
    UnsafeCheckpointError,
)
from fsdp_ext.checkpoint.planner import SpreadSavePlanner, item_nbytes, spread_plans
from fsdp_ext.checkpoint.reader import SafeLoadPlanner, VerifiedFileSystemReader
from fsdp_ext.checkpoint.steps import checkpoint_steps, step_name
from fsdp_ext.checkpoint.storage import CheckpointStorage
from fsdp_ext.checkpoint.verify import CheckpointReport, verify_checkpoint
from fsdp_ext.checkpoint.versions import CheckpointExistsError, remove_checkpoint
from fsdp_ext.checkpoint.writer import SpreadFileSystemWriter

__all__ = [
    "BEATS_PER_LEASE",
    "LEASE_ENV",
    "MIN_LEASE_S",
    "RUN_ID_ENV",
    "BlobAccessError",
    "BlobChangedError",
    "BlobConditionError",
    "BlobError",
    "BlobExistsError",
    "BlobInfo",
    "BlobNotFoundError",
    "BlobStorageReader",
    "BlobStorageWriter",
    "BlobStore",
    "CheckpointBusyError",
    "CheckpointExistsError",
    "CheckpointIntegrityError",
    "CheckpointPathError",
    "CheckpointPrunedError",
    "CheckpointReport",
    "CheckpointSpaceError",
    "CheckpointStorage",
    "DirectoryFencedError",
    "ExportConfig",
    "ExportReport",
    "LocalStorage",
    "SafeLoadPlanner",
    "SpreadFileSystemWriter",
    "SpreadSavePlanner",
    "UnsafeCheckpointError",
    "VerifiedFileSystemReader",
    "blob_store_for",
    "check_lease",
    "checkpoint_steps",
    "default_layer_key",
    "export_safetensors",
    "is_object_store",
    "item_nbytes",
    "read_lease",
    "remove_checkpoint",
    "spread_plans",
    "step_name",
    "unlock",
    "verify_checkpoint",
]
