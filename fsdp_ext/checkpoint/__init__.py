"""DCP checkpointing: spread replicated writes, per-layer files, atomic commit, verified loads.

Everything is used through the stock ``dcp.save`` / ``dcp.async_save`` / ``dcp.load`` calls.
"""

from fsdp_ext.checkpoint.layers import default_layer_key as default_layer_key
from fsdp_ext.checkpoint.manifest import CheckpointIntegrityError as CheckpointIntegrityError
from fsdp_ext.checkpoint.manifest import UnsafeCheckpointError as UnsafeCheckpointError
from fsdp_ext.checkpoint.planner import SpreadSavePlanner as SpreadSavePlanner
from fsdp_ext.checkpoint.planner import spread_plans as spread_plans
from fsdp_ext.checkpoint.reader import SafeLoadPlanner as SafeLoadPlanner
from fsdp_ext.checkpoint.reader import VerifiedFileSystemReader as VerifiedFileSystemReader
from fsdp_ext.checkpoint.verify import CheckpointReport as CheckpointReport
from fsdp_ext.checkpoint.verify import verify_checkpoint as verify_checkpoint
from fsdp_ext.checkpoint.writer import SpreadFileSystemWriter as SpreadFileSystemWriter
