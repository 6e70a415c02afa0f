"""Expert and dense FSDP units each take a custom reduce-scatter (what a comm hook installs).

World 4, ep=2: experts reduce-scatter over efsdp (2 ranks) as a plain SUM with the dp divide
factor applied after; dense units average over all 4. Grads still match the reference.
"""

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

from benchmarks.moe import Case, build_model, global_batch, lm_loss
from fsdp_ext import ParallelDims, apply_expert_parallel, shard_moe_model
from fsdp_ext.moe.layer import GroupedExperts
from fsdp_ext.testing import run_distributed

CASE = Case(num_layers=1)


class RecordingReduceScatter(DefaultReduceScatter):
    def __init__(self):
        self.calls = []

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        self.calls.append((group.size(), str(op)))
        return super().__call__(output_tensor, input_tensor, group, op, async_op)


def _with_custom_reduce_scatter():
    dims = ParallelDims(dist.get_world_size(), ep=2)
    dims.build_mesh("cpu")
    model = build_model(CASE)
    apply_expert_parallel(model, dims)
    shard_moe_model(model, dims)
    comms = {}
    for name, module in model.named_modules():
        if isinstance(module, FSDPModule):
            comms[name or "<root>"] = comm = RecordingReduceScatter()
            module.set_custom_reduce_scatter(comm)  # raises with more than one param group
    kinds = {
        (name or "<root>"): isinstance(m, GroupedExperts)
        for name, m in model.named_modules()
        if isinstance(m, FSDPModule)
    }
    per_rank = CASE.global_batch // dims.dp
    rank = dims.dp_flat_mesh.get_local_rank()
    inputs, targets = global_batch(CASE, 0)
    rows = slice(rank * per_rank, (rank + 1) * per_rank)
    lm_loss(model, inputs[rows], targets[rows]).backward()
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    # A unit that manages no parameters of its own (the root, once every parameterised
    # child is a unit) has nothing to reduce.
    owns_params = {
        (name or "<root>"): m._get_fsdp_state()._fsdp_param_group is not None
        for name, m in model.named_modules()
        if isinstance(m, FSDPModule)
    }
    return {
        "calls": {n: c.calls for n, c in comms.items()},
        "experts": kinds,
        "owns_params": owns_params,
        "grads": grads,
    }


def test_custom_reduce_scatter_on_expert_and_dense_units():
    reference = build_model(CASE)
    lm_loss(reference, *global_batch(CASE, 0)).backward()
    for run in run_distributed(_with_custom_reduce_scatter, 4):
        assert sum(run["experts"].values()) == CASE.num_layers
        for name, calls in run["calls"].items():
            if run["experts"][name]:
                assert calls == [(2, "RedOpType.SUM")], name  # efsdp group, SUM then / dp
            elif run["owns_params"][name]:
                assert calls == [(4, "RedOpType.AVG")], name
            else:
                assert calls == [], name
        assert sum(run["owns_params"].values()) > CASE.num_layers
        for name, p in reference.named_parameters():
            atol = 1e-7 * float(p.grad.abs().max())
            torch.testing.assert_close(run["grads"][name], p.grad, rtol=1e-5, atol=atol, msg=name)


def _bad_policy_then_good_policy():
    from torch import nn
    from torch.distributed.tensor import DTensor

    dims = ParallelDims(dist.get_world_size(), ep=2)
    dims.build_mesh("cpu")
    model = build_model(CASE)
    apply_expert_parallel(model, dims)

    def local(p):
        return p.to_local() if isinstance(p, DTensor) else p

    before = {n: local(p).detach().clone() for n, p in model.named_parameters()}
    out = {}
    try:  # a ModuleList has no forward: FSDP2 could never gather it
        shard_moe_model(model, dims, auto_wrap_policy={nn.ModuleList})
    except ValueError as e:
        out["error"] = str(e)
    out["fsdp_modules"] = [n for n, m in model.named_modules() if isinstance(m, FSDPModule)]
    # experts stay the ep DTensors apply_expert_parallel made, everything else plain
    out["dtensor_params"] = sorted(n for n, p in model.named_parameters() if isinstance(p, DTensor))
    out["unchanged"] = all(torch.equal(local(p), before[n]) for n, p in model.named_parameters())
    shard_moe_model(model, dims)  # the model is still usable with a good policy
    out["fsdp_after"] = [n for n, m in model.named_modules() if isinstance(m, FSDPModule)]
    return out


def test_bad_policy_raises_before_anything_is_sharded():
    for run in run_distributed(_bad_policy_then_good_policy, 2):
        assert "auto_wrap_policy selected 'layers'" in run.get("error", ""), run
        assert run["fsdp_modules"] == []
        assert run["dtensor_params"] == [
            f"layers.0.feed_forward.experts.{w}" for w in ("w1", "w2", "w3")
        ]
        assert run["unchanged"]
        assert {"", "layers.0.feed_forward.experts"} <= set(run["fsdp_after"])
