"""DCP checkpointing: spread replicated writes, per-layer files, atomic overwrite, verified loads.

Everything is used through the stock ``dcp.save`` / ``dcp.async_save`` / ``dcp.load`` calls.
"""

from fsdp_ext.checkpoint.fs import CheckpointFS
from fsdp_ext.checkpoint.layers import default_layer_key
from fsdp_ext.checkpoint.manifest import (
    CheckpointBusyError,
    CheckpointIntegrityError,
    CheckpointPathError,
    CheckpointSpaceError,
    UnsafeCheckpointError,
)
from fsdp_ext.checkpoint.planner import SpreadSavePlanner, item_nbytes, spread_plans
from fsdp_ext.checkpoint.reader import SafeLoadPlanner, VerifiedFileSystemReader
from fsdp_ext.checkpoint.verify import CheckpointReport, verify_checkpoint
from fsdp_ext.checkpoint.versions import CheckpointExistsError, remove_checkpoint
from fsdp_ext.checkpoint.writer import SpreadFileSystemWriter

__all__ = [
    "CheckpointBusyError",
    "CheckpointExistsError",
    "CheckpointFS",
    "CheckpointIntegrityError",
    "CheckpointPathError",
    "CheckpointReport",
    "CheckpointSpaceError",
    "SafeLoadPlanner",
    "SpreadFileSystemWriter",
    "SpreadSavePlanner",
    "UnsafeCheckpointError",
    "VerifiedFileSystemReader",
    "default_layer_key",
    "item_nbytes",
    "remove_checkpoint",
    "spread_plans",
    "verify_checkpoint",
]
