"""fsdp-ext: plugins for PyTorch FSDP2 (``torch.distributed.fsdp.fully_shard``).

The public surface: every name below, re-exported from its room (``fsdp_ext.wrap``,
``fsdp_ext.comm``, ``fsdp_ext.moe``, ``fsdp_ext.checkpoint``, ``fsdp_ext.pipeline``).

The pipeline names load on first use: ``torch.distributed.pipelining`` imports
``torch._dynamo``, about 1 s of CPU in every process that imports fsdp_ext, which only a
pipelined job should pay.
"""

from typing import TYPE_CHECKING

from fsdp_ext.checkpoint import (
    CheckpointBusyError,
    CheckpointIntegrityError,
    CheckpointPathError,
    CheckpointPrunedError,
    CheckpointReport,
    CheckpointSpaceError,
    DirectoryFencedError,
    SafeLoadPlanner,
    SpreadFileSystemWriter,
    SpreadSavePlanner,
    UnsafeCheckpointError,
    VerifiedFileSystemReader,
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
    Q4Config,
    WeightGatherHandle,
    WeightQuantConfig,
    auto_config,
    enable,
    register_weight_all_gather,
    unit_sizes,
)
from fsdp_ext.job import Checkpointer, DirectoryOwnedError, latest_intact
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
from fsdp_ext.straggler import Straggler, StragglerWatch, name_straggler
from fsdp_ext.wrap import (
    CostModel,
    GranularityPolicy,
    UnshardedBytesTracker,
    WrapPlan,
    calibrate_cost_model,
    node_local_reshard,
    plan_units,
    shard_by_policy,
)

if TYPE_CHECKING:
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


def __getattr__(name: str) -> object:
    # called only for names not bound above: in __all__, those are the pipeline's
    if name in __all__:
        from fsdp_ext import pipeline

        return getattr(pipeline, name)
    raise AttributeError(f"module 'fsdp_ext' has no attribute {name!r}")


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
    "DirectoryFencedError",
    "DirectoryOwnedError",
    "FSDPPipelineStage",
    "GranularityPolicy",
    "LoCoConfig",
    "LoCoReduceScatter",
    "MoE",
    "ParallelDims",
    "PipelineState",
    "Q4Config",
    "SafeLoadPlanner",
    "SpreadFileSystemWriter",
    "SpreadSavePlanner",
    "StagePlan",
    "Straggler",
    "StragglerWatch",
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
    "enable",
    "latest_intact",
    "name_straggler",
    "node_local_reshard",
    "pipeline_step",
    "plan_stages",
    "plan_units",
    "reduce_pipeline_loss",
    "register_weight_all_gather",
    "remove_checkpoint",
    "set_aux_loss_scale",
    "shard_by_policy",
    "shard_moe_model",
    "split_stages",
    "unit_sizes",
    "verify_checkpoint",
]
