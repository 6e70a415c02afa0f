"""fsdp-ext: plugins for PyTorch FSDP2 (``torch.distributed.fsdp.fully_shard``).

The public surface: every name below, re-exported from its room (``fsdp_ext.wrap``,
``fsdp_ext.comm``, ``fsdp_ext.moe``, ``fsdp_ext.checkpoint``, ``fsdp_ext.pipeline``).
"""

from fsdp_ext.checkpoint import (
    CheckpointIntegrityError,
    CheckpointReport,
    SafeLoadPlanner,
    SpreadFileSystemWriter,
    SpreadSavePlanner,
    UnsafeCheckpointError,
    VerifiedFileSystemReader,
    verify_checkpoint,
)
from fsdp_ext.comm import CommHandle, CommStats, LoCoConfig, LoCoReduceScatter, register_comm_hook
from fsdp_ext.moe import (
    MoE,
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
    plan_units,
)

__all__ = [
    "CheckpointIntegrityError",
    "CheckpointReport",
    "CommHandle",
    "CommStats",
    "CostModel",
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
    "WrapPlan",
    "apply_expert_parallel",
    "build_pipeline",
    "calibrate_cost_model",
    "clip_grad_norm_",
    "fully_shard",
    "pipeline_step",
    "plan_stages",
    "plan_units",
    "reduce_pipeline_loss",
    "register_comm_hook",
    "set_aux_loss_scale",
    "shard_moe_model",
    "split_stages",
    "verify_checkpoint",
]
