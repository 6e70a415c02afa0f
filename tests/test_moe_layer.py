"""The MoE layer at ep=1 (pure torch) against a per-token loop; aux loss; argument checks."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fsdp_ext
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
    with pytest.raises(ValueError, match="auto_wrap_policy"):
        shard_moe_model(model, ParallelDims(1), auto_wrap_policy=42)


# ------------------------------------------------ aux loss under loss scaling


def _aux_moe() -> MoE:
    torch.manual_seed(0)
    return MoE(4, 8, num_experts=4, top_k=2, load_balance_coef=AUX_COEF)


AUX_COEF = 0.1


def _explicit_aux(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """The Switch loss written out (independent of the layer's code), with its graph."""
    probs = F.softmax(x @ moe.router.gate.weight.t(), dim=-1)
    counts = torch.bincount(torch.topk(probs, 2).indices.flatten(), minlength=4).float()
    return AUX_COEF * 4 * (counts / counts.sum() * probs.mean(0)).sum()


def _main_loss(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    # x100: the router gradients of this loss and of the aux loss are of one size
    return moe(x).sum(-1).mean() * 100


def _router_grads_main_and_aux(x: torch.Tensor, scale: float, n_micro: int = 1):
    """Router gradient of (main + aux), unscaled, and of the main loss alone, as a loop
    with a GradScaler of ``scale`` and ``n_micro`` accumulation steps computes them."""
    moe = _aux_moe()
    opt = torch.optim.SGD(moe.parameters(), lr=0.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=scale)
    fsdp_ext.set_aux_loss_scale(moe, scaler.get_scale() / n_micro)
    for chunk in x.chunk(n_micro):
        scaler.scale(_main_loss(moe, chunk) / n_micro).backward()
    scaler.unscale_(opt)
    total = moe.router.gate.weight.grad.clone()
    moe.zero_grad()
    moe.load_balance_coef = 0.0
    for chunk in x.chunk(n_micro):
        (_main_loss(moe, chunk) / n_micro).backward()
    return total, moe.router.gate.weight.grad.clone()


def test_aux_share_of_router_grad_is_the_same_under_a_grad_scaler():
    x = torch.randn(32, 4)
    moe = _aux_moe()
    (aux_grad,) = torch.autograd.grad(_explicit_aux(moe, x), moe.router.gate.weight)
    plain_total, main = _router_grads_main_and_aux(x, scale=1.0)
    scaled_total, scaled_main = _router_grads_main_and_aux(x, scale=1024.0)
    torch.testing.assert_close(scaled_main, main)
    for total in (plain_total, scaled_total):
        torch.testing.assert_close(total - main, aux_grad, rtol=1e-5, atol=1e-8)
    # the aux share of the router gradient (0.62 here; 1/1024 of it when the aux loss
    # ignored the scale)
    share = [
        float((t - main).norm() / ((t - main).norm() + main.norm()))
        for t in (plain_total, scaled_total)
    ]
    assert 0.1 < share[0] < 0.9 and abs(share[1] - share[0]) <= 1e-5 * share[0], share


def test_aux_grad_with_accumulation_equals_the_full_batch_grad():
    n = 4
    # n identical microbatches: each one's routing statistics are the full batch's, so the
    # accumulated gradient must equal the gradient of one full-batch step
    micro = torch.randn(8, 4)
    full_batch = torch.cat([micro] * n)
    accumulated, _ = _router_grads_main_and_aux(full_batch, scale=1.0, n_micro=n)
    full, _ = _router_grads_main_and_aux(full_batch, scale=1.0, n_micro=1)
    torch.testing.assert_close(accumulated, full, rtol=1e-5, atol=1e-8)
    # distinct microbatches, with a GradScaler too: the mean over microbatches of
    # (main + aux), written out by hand
    x = torch.randn(32, 4)
    got, _ = _router_grads_main_and_aux(x, scale=256.0, n_micro=n)
    moe = _aux_moe()
    moe.load_balance_coef = 0.0  # the layer adds nothing; the aux loss is written out
    want = sum((_main_loss(moe, c) + _explicit_aux(moe, c)) / n for c in x.chunk(n))
    (want_grad,) = torch.autograd.grad(want, moe.router.gate.weight)
    torch.testing.assert_close(got, want_grad, rtol=1e-5, atol=1e-8)


def test_set_aux_loss_scale_checks_its_argument():
    moe = _aux_moe()
    assert fsdp_ext.set_aux_loss_scale(nn.Sequential(moe, moe), 2.0) == 1
    assert fsdp_ext.set_aux_loss_scale(moe, torch.tensor(8.0)) == 1
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="scale must be"):
            fsdp_ext.set_aux_loss_scale(moe, bad)
    for bad in ("1", None, True, torch.tensor([1, 2]), torch.tensor(3)):
        with pytest.raises(TypeError, match="scale must be"):
            fsdp_ext.set_aux_loss_scale(moe, bad)
