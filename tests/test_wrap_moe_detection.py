"""MoE blocks are found by structure (a router beside a container of alike experts), not
only by a child named ``experts``: routed experts called ``mlps`` keep the hang guard.

On 2 gloo ranks, rank 0's tokens avoid one expert that rank 1 uses, and no token reaches
another: without the guard FSDP2 skips the gradient-less parameters on rank 0 only, and
the two ranks' reduce-scatters no longer match.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import fsdp_ext
from fsdp_ext import MoE
from fsdp_ext.testing import run_distributed
from fsdp_ext.wrap.tree import has_expert_child

WORLD = 2
VOCAB, DIM, HIDDEN, NUM_EXPERTS = 32, 16, 8, 4
IDLE_EVERYWHERE, IDLE_ON_RANK0 = 0, 1


class TinyExpert(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(DIM, HIDDEN, bias=False)
        self.down = nn.Linear(HIDDEN, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.up(x)))


class RenamedMoE(nn.Module):
    """HF-style top-1 MoE that skips idle experts; nothing in it is named "expert"."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(DIM, NUM_EXPERTS, bias=False)
        self.mlps = nn.ModuleList(TinyExpert() for _ in range(NUM_EXPERTS))
        self.banned: list[int] = [IDLE_EVERYWHERE]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, DIM)
        logits = self.router(tokens)
        logits[:, self.banned] = float("-inf")
        weight, chosen = F.softmax(logits, dim=-1).max(dim=-1)
        out = torch.zeros_like(tokens)
        for index, mlp in enumerate(self.mlps):
            rows = torch.where(chosen == index)[0]
            if rows.numel():
                out = out.index_add(0, rows, mlp(tokens[rows]) * weight[rows, None])
        return out.view_as(x)


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.moe = RenamedMoE()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.moe(self.norm(x))


class RenamedMoELM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Layer() for _ in range(2))
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _model(banned_rank0: bool) -> RenamedMoELM:
    torch.manual_seed(0)
    model = RenamedMoELM()
    for layer in model.layers:
        layer.moe.banned = [IDLE_EVERYWHERE] + ([IDLE_ON_RANK0] if banned_rank0 else [])
    return model


def _tokens(rank: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(rank))


def _loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())


def _rank_grads() -> dict[str, torch.Tensor]:
    rank = dist.get_rank()
    model = _model(banned_rank0=rank == 0)
    policy = fsdp_ext.GranularityPolicy()  # one unit per layer
    fsdp_ext.shard_by_policy(model, auto_wrap_policy=policy, mesh=init_device_mesh("cpu", (WORLD,)))
    _loss(model, _tokens(rank)).backward()
    return {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}


def test_structure_finds_moe_blocks_and_nothing_else():
    model = RenamedMoELM()
    assert [n for n, m in model.named_modules() if has_expert_child(m)] == [
        "layers.0.moe",
        "layers.1.moe",
    ]
    # stacked [E, ...] experts beside a router (the library's own MoE, experts renamed)
    moe = MoE(DIM, HIDDEN, NUM_EXPERTS, 2)
    moe.register_module("grouped", moe._modules.pop("experts"))
    assert has_expert_child(moe)
    # dense look-alikes: a ModuleList of alike blocks beside a Linear that is not a router
    assert not has_expert_child(
        nn.ModuleDict(
            {"blocks": nn.ModuleList(TinyExpert() for _ in range(4)), "head": nn.Linear(DIM, 3)}
        )
    )
    assert not has_expert_child(
        nn.ModuleDict({"blocks": nn.ModuleList([TinyExpert()]), "gate": nn.Linear(DIM, 1)})
    )


def test_per_expert_units_refused_for_renamed_experts():
    with pytest.raises(ValueError, match=r"routed experts 'layers.0.moe.mlps'.*hangs"):
        fsdp_ext.shard_by_policy(RenamedMoELM(), auto_wrap_policy={TinyExpert})


def test_renamed_idle_experts_get_zero_grads_without_hang():
    runs = run_distributed(_rank_grads, WORLD, timeout=60)
    # reference: one process, both ranks' tokens with their own bans, mean of the losses
    losses = [_loss(_model(banned_rank0=r == 0), _tokens(r)) for r in range(WORLD)]
    reference = {}
    for r in range(WORLD):
        model = _model(banned_rank0=r == 0)
        (_loss(model, _tokens(r)) / WORLD).backward()
        for n, p in model.named_parameters():
            g = torch.zeros_like(p) if p.grad is None else p.grad
            reference[n] = reference.get(n, 0) + g
    assert all(torch.isfinite(loss) for loss in losses)
    for grads in runs:
        assert grads.keys() == reference.keys()
        for name, want in reference.items():
            torch.testing.assert_close(grads[name], want, rtol=1e-5, atol=1e-7, msg=name)
        for layer in range(2):
            idle = grads[f"layers.{layer}.moe.mlps.{IDLE_EVERYWHERE}.up.weight"]
            assert torch.count_nonzero(idle) == 0
            used_by_rank1_only = grads[f"layers.{layer}.moe.mlps.{IDLE_ON_RANK0}.up.weight"]
            assert torch.count_nonzero(used_by_rank1_only) > 0
