"""A small byte-level decoder-only transformer. It knows nothing of parallelism."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from fsdp_ext import MoE
from fsdp_ext.moe import SwiGLU


def _flag(default, help: str, low: int = 1):
    """A field that examples/train.py offers as a flag: its --help text and least value."""
    return field(default=default, metadata={"help": help, "low": low})


@dataclass
class ModelConfig:
    vocab_size: int = 256
    dim: int = _flag(128, "model width")
    n_layers: int = _flag(4, "transformer blocks")
    n_heads: int = _flag(4, "attention heads (must divide --dim)")
    hidden_dim: int = _flag(384, "width of the dense feed-forward (with --num-experts 0)")
    max_seq_len: int = 128
    norm_eps: float = 1e-5
    num_experts: int = _flag(8, "experts per MoE layer; 0: a dense SwiGLU feed-forward", low=0)
    top_k: int = _flag(2, "experts each token is routed to")
    moe_hidden_dim: int = 192  # per expert; top-2 of 192 costs about one dense 384
    load_balance_coef: float = 0.01


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.wqkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.wqkv(x).view(b, t, 3, self.n_heads, d // self.n_heads).unbind(2)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.wo(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attention_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.feed_forward = (
            MoE(
                cfg.dim,
                cfg.moe_hidden_dim,
                cfg.num_experts,
                cfg.top_k,
                load_balance_coef=cfg.load_balance_coef,
            )
            if cfg.num_experts > 0
            else SwiGLU(cfg.dim, cfg.hidden_dim)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig | None = None):
        super().__init__()
        cfg = cfg or ModelConfig()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.pos_embeddings = nn.Embedding(cfg.max_seq_len, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2 style: small normal weights, residual projections scaled by depth."""
        for name, p in self.named_parameters():
            if p.dim() < 2:
                continue
            std = (
                0.02 / (2 * self.cfg.n_layers) ** 0.5
                if name.endswith(("wo.weight", "w2.weight", "experts.w2"))
                else 0.02
            )
            nn.init.normal_(p, mean=0.0, std=std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        # A pipeline stage (fsdp_ext.split_stages) holds None for the modules of other
        # stages: a later stage gets hidden states, not tokens.
        h = tokens
        if self.tok_embeddings is not None:
            pos = torch.arange(tokens.shape[1], device=tokens.device)
            h = self.tok_embeddings(tokens) + self.pos_embeddings(pos)
        for layer in self.layers:
            h = layer(h)
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None else h
