"""fsdp-ext: plugins for PyTorch FSDP2 (``torch.distributed.fsdp.fully_shard``)."""

from fsdp_ext.moe import MoE, ParallelDims, apply_expert_parallel, clip_grad_norm_, shard_moe_model
