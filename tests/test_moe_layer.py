"""The MoE layer at ep=1 (pure torch) against a per-token loop; aux loss; argument checks."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fsdp_ext import MoE, ParallelDims, shard_moe_model


def _per_token(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """The definition, one token at a time: sum_j w_j * SwiGLU_{e_j}(x) (+ shared expert)."""
    tokens = x.reshape(-1, x.shape[-1])
    probs = F.softmax(moe.router.gate(tokens).float(), dim=-1)
    out = []
    for t, p in zip(tokens, probs, strict=True):
        w, e = torch.topk(p, moe.top_k)
        w = w / w.sum()
        ex = moe.experts
        y = sum(
            wi * (F.silu(ex.w1[ei] @ t) * (ex.w3[ei] @ t)) @ ex.w2[ei].t()
            for wi, ei in zip(w, e, strict=True)
        )
        if moe.shared_expert is not None:
            y = y + moe.shared_expert(t)
        out.append(y)
    return torch.stack(out).view_as(x)


@pytest.mark.parametrize("top_k", [1, 2, 3])
@pytest.mark.parametrize("shared", [0, 8])
def test_forward_and_grads_match_per_token_loop(top_k, shared):
    torch.manual_seed(top_k)
    moe = MoE(6, 10, num_experts=5, top_k=top_k, shared_hidden_dim=shared)
    x = torch.randn(3, 7, 6, requires_grad=True)
    out = moe(x)
    ref = _per_token(moe, x)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    grads = torch.autograd.grad(out.square().sum(), [x, *moe.parameters()])
    ref_grads = torch.autograd.grad(ref.square().sum(), [x, *moe.parameters()])
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)


def test_expert_without_tokens_gets_exactly_zero_grad():
    torch.manual_seed(0)
    moe = MoE(4, 8, num_experts=4, top_k=1)
    with torch.no_grad():
        moe.router.gate.weight[2] = -100.0  # never the top choice for these inputs
    x = torch.rand(16, 4) + 0.5
    moe(x).sum().backward()
    for w in (moe.experts.w1, moe.experts.w2, moe.experts.w3):
        assert torch.count_nonzero(w.grad[2]) == 0
        assert torch.count_nonzero(w.grad) > 0


def test_load_balance_loss_value_and_gradient():
    torch.manual_seed(0)
    coef = 0.1
    moe = MoE(4, 8, num_experts=4, top_k=2, load_balance_coef=coef)
    x = torch.randn(32, 4)
    moe(x).sum().backward()
    got = moe.router.gate.weight.grad.clone()
    # by hand: coef * E * sum_e f_e * P_e, f from hard counts (no grad), P the mean prob
    probs = F.softmax(x @ moe.router.gate.weight.t(), dim=-1)
    counts = torch.bincount(torch.topk(probs, 2).indices.flatten(), minlength=4).float()
    aux = coef * 4 * (counts / counts.sum() * probs.mean(0)).sum()
    torch.testing.assert_close(moe.aux_loss, aux.detach())
    moe.zero_grad()
    moe.load_balance_coef = 0.0
    moe(x).sum().backward()
    (aux_grad,) = torch.autograd.grad(aux, moe.router.gate.weight)
    torch.testing.assert_close(got, moe.router.gate.weight.grad + aux_grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"dim": 0}, "dim must be"),
        ({"num_experts": 0}, "num_experts must be"),
        ({"top_k": 5}, "top_k must be"),
        ({"top_k": 0}, "top_k must be"),
        ({"load_balance_coef": -1.0}, "load_balance_coef"),
    ],
)
def test_bad_arguments(kwargs, match):
    args = {"dim": 4, "hidden_dim": 8, "num_experts": 4, "top_k": 2, **kwargs}
    with pytest.raises(ValueError, match=match):
        MoE(**args)


def test_shard_moe_model_argument_checks():
    model = nn.Sequential(MoE(4, 8, 4, 2))
    with pytest.raises(TypeError, match="mesh"):
        shard_moe_model(model, ParallelDims(1), mesh=None)
    with pytest.raises(TypeError, match="auto_wrap_policy"):
        shard_moe_model(model, ParallelDims(1), auto_wrap_policy=42)
