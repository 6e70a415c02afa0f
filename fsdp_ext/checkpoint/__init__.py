"""DCP checkpointing: spread replicated writes, per-layer files, atomic overwrite, verified loads.

Everything is used through the stock ``dcp.save`` / ``dcp.async_save`` / ``dcp.load`` calls;
``Checkpointer`` does a training loop's save / prune / resume in two lines.
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
from fsdp_ext.checkpoint.checkpointer import Checkpointer, ModelOptimizerState
from fsdp_ext.checkpoint.export import ExportConfig, ExportReport, export_safetensors
from fsdp_ext.checkpoint.fs import LocalStorage
from fsdp_ext.checkpoint.layers import default_layer_key
from fsdp_ext.checkpoint.location import blob_store_for
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
from fsdp_ext.checkpoint.ownership import (
    LAUNCHER_PID_ENV,
    DirectoryFencedError,
    DirectoryOwnedError,
    Ownership,
    claim,
    exit_with_launcher,
)
from fsdp_ext.checkpoint.planner import SpreadSavePlanner, item_nbytes, spread_plans
from fsdp_ext.checkpoint.reader import SafeLoadPlanner, VerifiedFileSystemReader
from fsdp_ext.checkpoint.resume import checkpoint_steps, latest_intact, load_intact, step_name
from fsdp_ext.checkpoint.snapshot import Snapshots, clean_snapshots, job_name, snapshot_dir
from fsdp_ext.checkpoint.storage import CheckpointStorage
from fsdp_ext.checkpoint.verify import CheckpointReport, verify_checkpoint
from fsdp_ext.checkpoint.versions import CheckpointExistsError, remove_checkpoint
from fsdp_ext.checkpoint.writer import SpreadFileSystemWriter

__all__ = [
    "BEATS_PER_LEASE",
    "LAUNCHER_PID_ENV",
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
    "BlobStore",
    "CheckpointBusyError",
    "CheckpointExistsError",
    "CheckpointIntegrityError",
    "CheckpointPathError",
    "CheckpointPrunedError",
    "CheckpointReport",
    "CheckpointSpaceError",
    "CheckpointStorage",
    "Checkpointer",
    "DirectoryFencedError",
    "DirectoryOwnedError",
    "ExportConfig",
    "ExportReport",
    "LocalStorage",
    "ModelOptimizerState",
    "Ownership",
    "SafeLoadPlanner",
    "Snapshots",
    "SpreadFileSystemWriter",
    "SpreadSavePlanner",
    "UnsafeCheckpointError",
    "VerifiedFileSystemReader",
    "blob_store_for",
    "check_lease",
    "checkpoint_steps",
    "claim",
    "clean_snapshots",
    "default_layer_key",
    "exit_with_launcher",
    "export_safetensors",
    "item_nbytes",
    "job_name",
    "latest_intact",
    "load_intact",
    "read_lease",
    "remove_checkpoint",
    "snapshot_dir",
    "spread_plans",
    "step_name",
    "unlock",
    "verify_checkpoint",
]
