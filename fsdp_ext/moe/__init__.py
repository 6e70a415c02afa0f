"""MoE and expert parallelism: the MoE layer, all-to-all dispatch, sharding, clipping."""

from fsdp_ext.moe.expert_parallel import AllToAllStats, all_to_all_stats, apply_expert_parallel
from fsdp_ext.moe.grad_norm import clip_grad_norm_
from fsdp_ext.moe.layer import MoE, SwiGLU, set_aux_loss_scale
from fsdp_ext.moe.sharding import shard_moe_model

__all__ = [
    "AllToAllStats",
    "MoE",
    "SwiGLU",
    "all_to_all_stats",
    "apply_expert_parallel",
    "clip_grad_norm_",
    "set_aux_loss_scale",
    "shard_moe_model",
]
