"""The public counters benchmarks read, against what the collectives themselves were handed.

- ``fsdp_ext.all_to_all_stats``: the EP all-to-all bytes each rank sent, against a wrapper
  on ``dist.all_to_all_single`` that reads the tensors and split sizes of every call;
- ``fsdp_ext.testing.CountingReduceScatter`` / ``CountingAllGather``: calls and ring bytes
  of FSDP2's collectives against a closed form for two ``nn.Linear(8, 8)`` units;
- ``fsdp_ext.testing.fsdp_units``, ``CommHandle.units`` / ``reduce_scatters``: the units and
  the comm FSDP2 actually calls on each;
- ``UnshardedBytesTracker(modules)``: counts only its own model's units, parameters and
  gradients apart.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard

import fsdp_ext
from benchmarks.moe import Case, build_model, global_batch, lm_loss
from fsdp_ext.testing import CountingAllGather, CountingReduceScatter, fsdp_units, run_distributed

LINEAR_BYTES = (8 * 8 + 8) * 4  # one nn.Linear(8, 8) in fp32


def _all_to_all_rank() -> dict:
    dims = fsdp_ext.ParallelDims(dist.get_world_size(), ep=2)
    dims.build_mesh("cpu")
    case = Case(num_layers=2)
    model = build_model(case)
    fsdp_ext.apply_expert_parallel(model, dims)
    fsdp_ext.shard_moe_model(model, dims)
    me = dist.get_rank()
    wire = {"sent": 0, "received": 0, "exchanges": 0}
    stock = dist.all_to_all_single

    def counted(output, input, output_split_sizes=None, input_split_sizes=None, **kw):
        if input_split_sizes is not None:  # the row exchanges (the count exchange has none)
            row = input[0:1].numel() * input.element_size() if input.shape[0] else 0
            out_row = output[0:1].numel() * output.element_size() if output.shape[0] else 0
            wire["sent"] += (input.shape[0] - input_split_sizes[me]) * row
            wire["received"] += (output.shape[0] - output_split_sizes[me]) * out_row
            wire["exchanges"] += 1
        return stock(output, input, output_split_sizes, input_split_sizes, **kw)

    dist.all_to_all_single = counted
    try:
        before = fsdp_ext.all_to_all_stats(model)
        inputs, targets = global_batch(case, 0)
        lm_loss(model, inputs, targets).backward()
        after = fsdp_ext.all_to_all_stats(model)
    finally:
        dist.all_to_all_single = stock
    return {
        "stats": (after.bytes_sent - before.bytes_sent, after.exchanges - before.exchanges),
        "wire": wire,
    }


def test_all_to_all_stats_match_the_wrapped_collective():
    results = run_distributed(_all_to_all_rank, 2)
    for r in results:
        assert r["stats"] == (r["wire"]["sent"], r["wire"]["exchanges"])
        assert r["wire"]["exchanges"] == 2 * 4  # two MoE layers: dispatch, combine, both ways
    # every byte sent is a byte received by the peer
    assert sum(r["stats"][0] for r in results) == sum(r["wire"]["received"] for r in results)
    assert all(r["stats"][0] > 0 for r in results)


def _fsdp_rank() -> dict:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    out = {}

    def model() -> nn.Sequential:
        return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))

    # counting comms: two units of one Linear each, the root holds nothing
    a = fsdp_ext.shard_by_policy(model(), auto_wrap_policy={nn.Linear}, mesh=mesh)
    rs, ag = CountingReduceScatter(), CountingAllGather()
    units = fsdp_units(a)
    out["units"] = [fqn for fqn, _ in units]
    for _, unit in units:
        unit.set_custom_reduce_scatter(rs)
        unit.set_custom_all_gather(ag)
    a(torch.randn(4, 8)).sum().backward()
    out["rs"], out["ag"] = (rs.calls, rs.wire_bytes), (ag.calls, ag.wire_bytes)

    # a unit of two modules is listed once
    grouped = model()
    torch_fully_shard([grouped[0], grouped[2]], mesh=mesh)
    torch_fully_shard(grouped, mesh=mesh)
    out["grouped_units"] = [fqn for fqn, _ in fsdp_units(grouped)]

    # the tracker of one model ignores another
    b = fsdp_ext.shard_by_policy(model(), auto_wrap_policy={nn.Linear}, mesh=mesh)
    tracker = fsdp_ext.UnshardedBytesTracker([a])
    with tracker:
        b(torch.randn(4, 8)).sum().backward()
    out["other_model"] = (tracker.samples, tracker.peak_bytes)
    with tracker:
        a(torch.randn(4, 8)).sum().backward()
    out["own_model"] = (tracker.peak_param_bytes, tracker.peak_grad_bytes, tracker.peak_bytes)

    # LoCo's handle names the units and the comm FSDP calls on each
    handle = fsdp_ext.enable(b, fsdp_ext.CommConfig(gradients=fsdp_ext.LoCoConfig(group_size=32)))
    b(torch.randn(4, 8)).sum().backward()
    out["handle_units"] = sorted(handle.units)
    out["same_modules"] = {id(m) for m in handle.units.values()} == {
        id(m) for _, m in fsdp_units(b)
    }
    out["reductions"] = {fqn: c.stats.reductions for fqn, c in handle.reduce_scatters.items()}
    return out


def test_fsdp_counters_units_and_tracker():
    results = run_distributed(_fsdp_rank, 2)
    half = LINEAR_BYTES // 2  # a ring of 2 sends half of the gathered buffer
    for r in results:
        assert r["units"] == ["0", "2"]
        assert r["rs"] == (2, 2 * half)  # one reduce-scatter per unit
        # forward gathers both; the non-root units reshard after forward and gather again
        assert r["ag"] == (4, 4 * half)
        assert r["grouped_units"] == ["0"]
        assert r["other_model"] == (0, 0)
        params, grads, total = r["own_model"]
        # backward: the unit computing holds its parameters while the next one is gathered
        # (FSDP2 prefetches one unit in backward); gradients are reduced unit by unit
        assert params == 2 * LINEAR_BYTES
        assert grads == LINEAR_BYTES
        assert max(params, grads) <= total <= params + grads
        assert r["handle_units"] == ["0", "2"] and r["same_modules"]
        assert r["reductions"] == {"0": 1, "2": 1}
