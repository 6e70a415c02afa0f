"""The benchmark model's fused RMSNorm computes what the decomposed one does."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.wrap_models import RMSNorm, _FusedRMSNormFunction


def _pair(dim: int, seed: int) -> tuple[RMSNorm, RMSNorm]:
    torch.manual_seed(seed)
    weight = torch.rand(dim, dtype=torch.float64) + 0.5
    norms = RMSNorm(dim, fused=True).double(), RMSNorm(dim, fused=False).double()
    for norm in norms:
        norm.weight.data.copy_(weight)
    return norms


@settings(max_examples=30, deadline=None)
@given(
    shape=st.lists(st.integers(1, 5), min_size=0, max_size=2),
    dim=st.integers(1, 17),
    seed=st.integers(0, 2**16),
)
def test_fused_norm_matches_decomposed_forward_and_gradients(shape, dim, seed):
    fused, decomposed = _pair(dim, seed)
    x = torch.randn(*shape, dim, dtype=torch.float64, requires_grad=True)
    grad_out = torch.randn(*shape, dim, dtype=torch.float64)
    results = []
    for norm in (fused, decomposed):
        out = norm(x)
        grads = torch.autograd.grad(out, (x, norm.weight), grad_out)
        results.append((out, *grads))
    assert torch.equal(results[0][0], results[1][0])
    for got, want in zip(results[0][1:], results[1][1:], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def _edges_into(x: torch.Tensor, out: torch.Tensor) -> int:
    """How many autograd edges end at ``x``: the number of gradient terms summed into it."""
    seen, stack, edges = set(), [out.grad_fn], 0
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for child, _ in node.next_functions:
            if child is not None and getattr(child, "variable", None) is x:
                edges += 1
            stack.append(child)
    return edges


def test_fused_norm_passes_gradcheck():
    x = torch.randn(3, 6, dtype=torch.float64, requires_grad=True)
    weight = (torch.rand(6, dtype=torch.float64) + 0.5).requires_grad_()
    assert torch.autograd.gradcheck(
        lambda x, w: _FusedRMSNormFunction.apply(x, w, 1e-6), (x, weight)
    )


def test_fused_norm_gives_its_input_one_gradient_and_decomposed_two():
    fused, decomposed = _pair(6, 0)
    x = torch.randn(3, 6, dtype=torch.float64, requires_grad=True)
    assert _edges_into(x, fused(x)) == 1
    assert _edges_into(x, decomposed(x)) == 2
