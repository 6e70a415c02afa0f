"""Pipeline parallelism composed with FSDP: stage splitting, per-stage FSDP units, schedules."""

from fsdp_ext.pipeline.build import SCHEDULES, build_pipeline
from fsdp_ext.pipeline.split import StagePlan, plan_stages, split_stages
from fsdp_ext.pipeline.stage import FSDPPipelineStage
from fsdp_ext.pipeline.training import PipelineState, pipeline_step, reduce_pipeline_loss

__all__ = [
    "SCHEDULES",
    "FSDPPipelineStage",
    "PipelineState",
    "StagePlan",
    "build_pipeline",
    "pipeline_step",
    "plan_stages",
    "reduce_pipeline_loss",
    "split_stages",
]
