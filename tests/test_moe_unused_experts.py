"""An expert that gets no tokens (on one rank, or anywhere) neither hangs nor gets a wrong grad.

The router is forced: experts in ``BANNED_EVERYWHERE`` never receive a token, and the
tokens of data-parallel rank 0 avoid every expert hosted by ep rank 1, so under ep=2 rank 0
sends zero rows to its peer (an all-to-all split of 0) and some experts see no tokens from
some ranks. The single-process reference applies the same ban to the same global rows.
"""

import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch import nn

from benchmarks.moe import Case, build_model, global_batch, lm_loss
from fsdp_ext import MoE, ParallelDims, apply_expert_parallel, shard_moe_model
from fsdp_ext.testing import run_distributed
from fsdp_ext.wrap.apply import NATIVE_UNUSED_PARAM_REDUCE_SCATTER

CASE = dataclasses.replace(Case(), num_layers=1, load_balance_coef=0.0)
BANNED_EVERYWHERE = [0]
BANNED_FOR_RANK0 = [4, 5, 6, 7]  # every expert of ep rank 1 when ep=2, num_experts=8


class BanningGate(nn.Module):
    """The router's gate, with chosen experts made impossible (-inf logit) for chosen rows."""

    def __init__(self, gate: nn.Linear):
        super().__init__()
        self.linear = gate
        self.banned_rows = 0  # the first banned_rows rows also avoid BANNED_FOR_RANK0

    def forward(self, x):
        logits = self.linear(x)
        mask = torch.zeros_like(logits)
        mask[:, BANNED_EVERYWHERE] = float("-inf")
        mask[: self.banned_rows, BANNED_FOR_RANK0] = float("-inf")
        return logits + mask


def _banned_model(rank0_rows: int):
    model = build_model(CASE)
    for moe in (m for m in model.modules() if isinstance(m, MoE)):
        moe.router.gate = BanningGate(moe.router.gate)
        moe.router.gate.banned_rows = rank0_rows
    return model


def _rank_grads(ep, native):
    import fsdp_ext.wrap.apply as apply

    apply.NATIVE_UNUSED_PARAM_REDUCE_SCATTER = native
    dims = ParallelDims(dist.get_world_size(), ep=ep)
    dims.build_mesh("cpu")
    per_rank = CASE.global_batch // dims.dp
    dp_rank = dims.dp_flat_mesh.get_local_rank()
    model = _banned_model(per_rank * CASE.seq_len if dp_rank == 0 else 0)
    apply_expert_parallel(model, dims)
    shard_moe_model(model, dims)
    splits = []  # in_splits of every token all-to-all: dispatch, combine, then backward's
    for moe in (m for m in model.modules() if isinstance(m, MoE) and ep > 1):
        exchange = moe.experts.dispatcher.all_to_all

        def recording(x, out_splits, in_splits, exchange=exchange):
            splits.append(list(in_splits))
            return exchange(x, out_splits, in_splits)

        moe.experts.dispatcher.all_to_all = recording
    inputs, targets = global_batch(CASE, 0)
    rows = slice(dp_rank * per_rank, (dp_rank + 1) * per_rank)
    lm_loss(model, inputs[rows], targets[rows]).backward()
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    return {"grads": grads, "splits": splits}


# The fallback hook (torch < 2.12) always; torch's own flag where this torch has it.
@pytest.mark.parametrize("native", sorted({False, NATIVE_UNUSED_PARAM_REDUCE_SCATTER}))
@pytest.mark.parametrize("ep", [1, 2])
def test_unused_experts_get_exact_zero_and_the_rest_match(ep, native):
    world = 2
    reference = _banned_model(CASE.global_batch // world * CASE.seq_len)
    lm_loss(reference, *global_batch(CASE, 0)).backward()
    runs = run_distributed(_rank_grads, world, ep, native, timeout=120)
    if ep == 2:
        # the dispatch all-to-all really had a zero split: rank 0 sent rank 1 no rows,
        # and the combine brought rank 1 none back from rank 0's experts
        dispatch0 = runs[0]["splits"][0]
        dispatch1, combine1 = runs[1]["splits"][:2]
        assert dispatch0[1] == 0 and dispatch0[0] == CASE.global_batch // 2 * CASE.seq_len * 2
        assert combine1[0] == 0 and dispatch1[0] > 0
        assert len(runs[0]["splits"]) == 4  # dispatch, combine, and both backward exchanges
    for run in runs:
        for name, expected in reference.named_parameters():
            got = run["grads"][name]
            if ".experts." in name:
                assert torch.count_nonzero(got[BANNED_EVERYWHERE]) == 0, name
                assert torch.count_nonzero(got[1:]) > 0, name
            # a few ulps of the largest entry: the ranks' halves add in another order than
            # the single process's (torch 2.11's matmuls: 2 ulps off on one shared weight)
            atol = 4 * torch.finfo(torch.float32).eps * float(expected.grad.abs().max())
            torch.testing.assert_close(got, expected.grad, rtol=1e-5, atol=atol, msg=name)
