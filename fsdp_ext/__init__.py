"""fsdp-ext: plugins for PyTorch FSDP2 (``torch.distributed.fsdp.fully_shard``)."""

from fsdp_ext.comm import CommHandle as CommHandle
from fsdp_ext.comm import LoCoConfig as LoCoConfig
from fsdp_ext.comm import LoCoReduceScatter as LoCoReduceScatter
from fsdp_ext.comm import register_comm_hook as register_comm_hook
from fsdp_ext.moe import MoE as MoE
from fsdp_ext.moe import ParallelDims as ParallelDims
from fsdp_ext.moe import apply_expert_parallel as apply_expert_parallel
from fsdp_ext.moe import clip_grad_norm_ as clip_grad_norm_
from fsdp_ext.moe import shard_moe_model as shard_moe_model
from fsdp_ext.wrap import CostModel as CostModel
from fsdp_ext.wrap import GranularityPolicy as GranularityPolicy
from fsdp_ext.wrap import UnshardedBytesTracker as UnshardedBytesTracker
from fsdp_ext.wrap import WrapPlan as WrapPlan
from fsdp_ext.wrap import calibrate_cost_model as calibrate_cost_model
from fsdp_ext.wrap import fully_shard as fully_shard
from fsdp_ext.wrap import plan_units as plan_units
