"""Models for the wrap tests and benchmark: DeepSpeed's granularity test model and a
fine-grained, Qwen2-MoE-like decoder (many tiny experts, each three bias-free Linears)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


class MLPBlock(nn.Module):
    """DeepSpeed ``test_zero_leaf_module.py``: granularity 3 * 128 * 128 / 4 = 12288."""

    def __init__(self, hidden_dim: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_dim, hidden_dim, bias=False)
        self.up_proj = nn.Linear(hidden_dim, hidden_dim, bias=False)
        self.down_proj = nn.Linear(hidden_dim, hidden_dim, bias=False)
        self.act_fn = nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class FineGrainedBlock(nn.Module):
    def __init__(self, hidden_dim: int, num_block: int):
        super().__init__()
        self.mlp_layers = nn.ModuleList([MLPBlock(hidden_dim) for _ in range(num_block)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.mlp_layers:
            x = layer(x)
        return x


class ModelWithFineGrainedBlock(nn.Module):
    """DeepSpeed's ``modelWithFineGrainedBlock`` (the loss moved out of forward)."""

    def __init__(self, hidden_dim: int = 128, num_block: int = 16):
        super().__init__()
        self.coarse_grained_layer1 = nn.Linear(hidden_dim, 8 * hidden_dim)
        self.coarse_grained_layer2 = nn.Linear(8 * hidden_dim, hidden_dim)
        self.fine_grained_layer = FineGrainedBlock(hidden_dim, num_block)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.coarse_grained_layer1(x)
        x = self.coarse_grained_layer2(x)
        return self.fine_grained_layer(x)


@dataclass
class FineMoEConfig:
    vocab_size: int = 256
    dim: int = 64
    n_layers: int = 8
    n_heads: int = 4
    num_experts: int = 64
    expert_hidden: int = 32
    top_k: int = 4
    shared_hidden: int = 128
    # HF-style routing calls only experts that got tokens; False calls every expert
    # (idle ones on an empty slice), which per-expert FSDP units need.
    skip_idle_experts: bool = False
    # One backward node per norm, as on GPUs; False keeps the decomposed eager norm.
    fused_norm: bool = True


class _FusedRMSNormFunction(torch.autograd.Function):
    """RMSNorm as one autograd node, the way a fused kernel runs it (torch's CUDA
    ``_fused_rms_norm``, apex, Liger): the input gets one gradient, not two."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return x * rstd * weight

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        x, weight, rstd = ctx.saved_tensors
        x_hat = x * rstd
        grad_x_hat = grad * weight
        grad_x = rstd * (grad_x_hat - x_hat * (grad_x_hat * x_hat).mean(-1, keepdim=True))
        grad_weight = (grad * x_hat).reshape(-1, x.shape[-1]).sum(0)
        return grad_x, grad_weight, None


class RMSNorm(nn.Module):
    """``fused=False`` is the decomposed eager form (HF's ``Qwen2RMSNorm``, torch's
    ``nn.RMSNorm`` on CPU), whose input gets two gradients, through ``x * rsqrt(..)``
    and through ``x.pow(2)``. At a unit boundary FSDP2 sums those two before the
    residual's, so the wrap changes the last bits of training (docs/wrap.md)."""

    def __init__(self, dim: int, eps: float = 1e-6, fused: bool = True):
        super().__init__()
        self.eps = eps
        self.fused = fused
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return _FusedRMSNormFunction.apply(x, self.weight, self.eps)
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Expert(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SparseMoeBlock(nn.Module):
    """Router + ``num_experts`` small experts + a gated shared expert (Qwen2-MoE shape)."""

    def __init__(self, cfg: FineMoEConfig):
        super().__init__()
        self.top_k = cfg.top_k
        self.skip_idle_experts = cfg.skip_idle_experts
        self.gate = nn.Linear(cfg.dim, cfg.num_experts, bias=False)
        self.experts = nn.ModuleList(
            [Expert(cfg.dim, cfg.expert_hidden) for _ in range(cfg.num_experts)]
        )
        # Tells fsdp_ext.shard_by_policy whether per-expert units are safe here.
        self.experts.experts_always_run = not cfg.skip_idle_experts
        self.shared_expert = Expert(cfg.dim, cfg.shared_hidden)
        self.shared_expert_gate = nn.Linear(cfg.dim, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., dim) -> (tokens, dim): a fresh tensor, not a view (FSDP2 hooks want that)."""
        x = x.reshape(-1, x.shape[-1])
        probs = F.softmax(self.gate(x), dim=-1)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        out = torch.zeros_like(x)
        for index, expert in enumerate(self.experts):
            token, slot = torch.where(chosen == index)
            if self.skip_idle_experts and token.numel() == 0:
                continue
            out.index_add_(0, token, expert(x[token]) * weights[token, slot, None])
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out + shared


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int):
        super().__init__()
        self.n_heads = n_heads
        self.q_proj = nn.Linear(dim, dim, bias=False)
        self.k_proj = nn.Linear(dim, dim, bias=False)
        self.v_proj = nn.Linear(dim, dim, bias=False)
        self.o_proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, s, self.n_heads, d // self.n_heads).transpose(1, 2)

        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, s, d))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: FineMoEConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.dim, fused=cfg.fused_norm)
        self.self_attn = Attention(cfg.dim, cfg.n_heads)
        self.post_attention_layernorm = RMSNorm(cfg.dim, fused=cfg.fused_norm)
        self.mlp = SparseMoeBlock(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x)).view_as(x)


class FineMoE(nn.Module):
    """Byte-level decoder LM whose MoE layers are made of many tiny modules."""

    def __init__(self, cfg: FineMoEConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList([DecoderLayer(cfg) for _ in range(cfg.n_layers)])
        self.norm = RMSNorm(cfg.dim, fused=cfg.fused_norm)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))
