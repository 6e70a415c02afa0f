"""Tiny HF transformers MoE configs shared by tests (built from config, nothing downloaded),
and the launch environment accelerate reads."""

from __future__ import annotations

import os

import torch.distributed as dist

TINY_DECODER = dict(
    vocab_size=64,
    hidden_size=32,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    tie_word_embeddings=False,
)


def tiny_qwen2_moe_config(num_hidden_layers: int = 2):
    """Qwen2-MoE with 8 top-2 experts and a shared expert in every layer."""
    from transformers import Qwen2MoeConfig

    return Qwen2MoeConfig(
        **TINY_DECODER,
        num_hidden_layers=num_hidden_layers,
        intermediate_size=64,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
    )


def set_launch_env(world: int) -> None:
    """The variables torchrun would set, which accelerate's state reads (inside a rank of
    ``run_distributed``, whose process group is already up)."""
    for key, value in {
        "RANK": dist.get_rank(),
        "WORLD_SIZE": world,
        "LOCAL_RANK": dist.get_rank(),
        "LOCAL_WORLD_SIZE": world,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500",
    }.items():
        os.environ[key] = str(value)
