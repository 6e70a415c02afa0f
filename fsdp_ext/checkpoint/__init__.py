"""DCP checkpointing: spread replicated writes, per-layer files, atomic commit, verified loads.

Everything is used through the stock ``dcp.save`` / ``dcp.async_save`` / ``dcp.load`` calls.
"""

from fsdp_ext.checkpoint.layers import default_layer_key
from fsdp_ext.checkpoint.manifest import CheckpointIntegrityError, UnsafeCheckpointError
from fsdp_ext.checkpoint.planner import SpreadSavePlanner, spread_plans
from fsdp_ext.checkpoint.reader import SafeLoadPlanner, VerifiedFileSystemReader
from fsdp_ext.checkpoint.verify import CheckpointReport, verify_checkpoint
from fsdp_ext.checkpoint.writer import SpreadFileSystemWriter

__all__ = [
    "CheckpointIntegrityError",
    "CheckpointReport",
    "SafeLoadPlanner",
    "SpreadFileSystemWriter",
    "SpreadSavePlanner",
    "UnsafeCheckpointError",
    "VerifiedFileSystemReader",
    "default_layer_key",
    "spread_plans",
    "verify_checkpoint",
]
