"""fsdp-ext: plugins for PyTorch FSDP2 (``torch.distributed.fsdp.fully_shard``).

The public surface: every name below, re-exported from its room (``fsdp_ext.wrap``,
``fsdp_ext.comm``, ``fsdp_ext.moe``, ``fsdp_ext.checkpoint``, ``fsdp_ext.pipeline``).
"""

from fsdp_ext.checkpoint import (
    CheckpointBusyError,
    Checkpointer,
    CheckpointIntegrityError,
    CheckpointPathError,
    CheckpointPrunedError,
    CheckpointReport,
    CheckpointSpaceError,
    DirectoryOwnedError,
    SafeLoadPlanner,
    SpreadFileSystemWriter,
    SpreadSavePlanner,
    UnsafeCheckpointError,
    VerifiedFileSystemReader,
    latest_intact,
    remove_checkpoint,
    verify_checkpoint,
)
from fsdp_ext.comm import (
    AutoDecision,
    CommConfig,
    CommHandle,
    CommStats,
    LoCoConfig,
    LoCoReduceScatter,
    WeightGatherHandle,
    WeightQuantConfig,
    auto_config,
    register_comm_hook,
    register_weight_all_gather,
    unit_sizes,
)
from fsdp_ext.moe import (
    AllToAllStats,
    MoE,
    all_to_all_stats,
    apply_expert_parallel,
    clip_grad_norm_,
    set_aux_loss_scale,
    shard_moe_model,
)
from fsdp_ext.parallel_dims import ParallelDims
from fsdp_ext.pipeline import (
    FSDPPipelineStage,
    PipelineState,
    StagePlan,
    build_pipeline,
    pipeline_step,
    plan_stages,
    reduce_pipeline_loss,
    split_stages,
)
from fsdp_ext.wrap import (
    CostModel,
    GranularityPolicy,
    UnshardedBytesTracker,
    WrapPlan,
    calibrate_cost_model,
    fully_shard,
    node_local_reshard,
    plan_units,
)

__all__ = [
    "AllToAllStats",
    "AutoDecision",
    "CheckpointBusyError",
    "CheckpointIntegrityError",
    "CheckpointPathError",
    "CheckpointPrunedError",
    "CheckpointReport",
    "CheckpointSpaceError",
    "Checkpointer",
    "CommConfig",
    "CommHandle",
    "CommStats",
    "CostModel",
    "DirectoryOwnedError",
    "FSDPPipelineStage",
    "GranularityPolicy",
    "LoCoConfig",
    "LoCoReduceScatter",
    "MoE",
    "ParallelDims",
    "PipelineState",
    "SafeLoadPlanner",
    "SpreadFileSystemWriter",
    "SpreadSavePlanner",
    "StagePlan",
    "UnsafeCheckpointError",
    "UnshardedBytesTracker",
    "VerifiedFileSystemReader",
    "WeightGatherHandle",
    "WeightQuantConfig",
    "WrapPlan",
    "all_to_all_stats",
    "apply_expert_parallel",
    "auto_config",
    "build_pipeline",
    "calibrate_cost_model",
    "clip_grad_norm_",
    "fully_shard",
    "latest_intact",
    "node_local_reshard",
    "pipeline_step",
    "plan_stages",
    "plan_units",
    "reduce_pipeline_loss",
    "register_comm_hook",
    "register_weight_all_gather",
    "remove_checkpoint",
    "set_aux_loss_scale",
    "shard_moe_model",
    "split_stages",
    "unit_sizes",
    "verify_checkpoint",
]


def __getattr__(name: str) -> object:
    """Deprecated names (``QuantizedAllGather``), with a warning naming the new one."""
    from fsdp_ext._deprecated import renamed_attribute

    return renamed_attribute(__name__, name, globals())
