"""LoCo's overlap: each unit's gradient exchange runs behind the backward of the unit before.

With ``CommConfig(overlap=True)`` (the default), a unit's reduce-scatter encodes its rows,
starts the all-to-all and returns; the decode that fills FSDP's output runs before the next
unit's exchange starts, or when the backward ends. That is safe only where FSDP2 merely views
the output until the optimizer reads it; everywhere else the exchange stays synchronous.

- The same bits as ``overlap=False``: losses, parameters, error feedback and byte counts,
  for fp32 and bf16 models, for hierarchical LoCo, and for the cases that must stay
  synchronous (a bf16 reduce of fp32 parameters, which FSDP casts at once; a second
  micro-batch, whose gradient FSDP adds to the first at once). The count of started
  (asynchronous) all-to-alls shows which ones were deferred.
- The order of events on each rank, recorded from outside the library (an autograd marker
  at each block's input and a wrapper around gloo's all-to-all that logs each start and
  each ``wait()``): block i's exchange starts before block i-1's backward compute ends and
  is waited for only after it, once block i-1's own exchange has started.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from fsdp_ext.comm import CommConfig, enable
from fsdp_ext.testing import run_distributed
from tests.overlap_cases import HIDDEN, WORLD, Marker, Net, batch, logged_collective

UNITS = len(HIDDEN) + 1  # the blocks and the root
# name -> (model dtype, reduce dtype of the mixed-precision policy, micro-batches per step,
#          hierarchical, exchanges that may be deferred per step)
CASES = {
    "fp32": (torch.float32, None, 1, False, UNITS),
    "bf16_model": (torch.bfloat16, None, 1, False, UNITS),
    "hierarchical": (torch.float32, None, 1, True, UNITS),
    "bf16_reduce_of_fp32": (torch.float32, torch.bfloat16, 1, False, 0),
    "two_micro_batches": (torch.float32, None, 2, False, UNITS),  # the first only
}


def _model(mesh, dtype: torch.dtype, reduce_dtype: torch.dtype | None) -> Net:
    torch.manual_seed(0)
    net = Net().to(dtype)
    mp = MixedPrecisionPolicy(reduce_dtype=reduce_dtype)
    for block in net.blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(net, mesh=mesh, mp_policy=mp)
    return net


def _count_async_all_to_alls() -> tuple[list[int], object]:
    """Patch gloo's all-to-all entry point to count the started (``async_op``) calls."""
    count, real = [0], dist.all_to_all_single

    def counted(*args, async_op=False, **kwargs):
        count[0] += async_op
        return real(*args, async_op=async_op, **kwargs)

    dist.all_to_all_single = counted
    return count, real


def _train_rank(steps: int) -> dict:
    mesh = init_device_mesh("cpu", (WORLD,))
    out = {}
    count, real = _count_async_all_to_alls()
    try:
        for name, (dtype, reduce_dtype, micro, hierarchical, _) in CASES.items():
            for overlap in (False, True):
                net = _model(mesh, dtype, reduce_dtype)
                config = CommConfig(
                    gradients="loco", hierarchical=hierarchical, node_size=1, overlap=overlap
                )
                handle = enable(net, config)
                optim = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
                losses, started = [], count[0]
                for step in range(steps):
                    for m in range(micro):
                        x, y = batch(step * micro + m)
                        loss = F.mse_loss(net(x.to(dtype)).float(), y)
                        loss.backward()
                        losses.append(loss.item())
                    optim.step()
                    optim.zero_grad()
                out[name, overlap] = {
                    "losses": losses,
                    "params": {n: p.full_tensor().clone() for n, p in net.named_parameters()},
                    "feedback": handle.state_dict(),
                    "bytes_sent": handle.stats.bytes_sent,
                    "reductions": handle.stats.reductions,
                    "async": count[0] - started,
                }
    finally:
        dist.all_to_all_single = real
    return out


def _flat(state, prefix=""):
    if isinstance(state, torch.Tensor):
        return {prefix: state}
    if isinstance(state, dict):
        found = {}
        for k, v in state.items():
            found.update(_flat(v, f"{prefix}/{k}"))
        return found
    return {prefix: state}


def test_deferred_exchanges_equal_the_synchronous_ones_bit_for_bit():
    """Three SGD steps on 2 gloo ranks per case, overlap off then on: the same losses,
    parameters, error feedback and byte counts; deferred exchanges exactly where FSDP only
    views the output (none where it casts it, only the first micro-batch's where it
    accumulates)."""
    steps = 3
    for rank_out in run_distributed(_train_rank, WORLD, steps):
        for name, (*_, deferred_per_step) in CASES.items():
            sync, over = rank_out[name, False], rank_out[name, True]
            assert over["losses"] == sync["losses"], name
            for n, p in sync["params"].items():
                assert torch.equal(over["params"][n], p), (name, n)
            sync_fb, over_fb = _flat(sync["feedback"]), _flat(over["feedback"])
            assert sync_fb.keys() == over_fb.keys() and sync_fb, name
            for k, v in sync_fb.items():
                if isinstance(v, torch.Tensor):
                    assert torch.equal(over_fb[k], v), (name, k)
                else:
                    assert over_fb[k] == v, (name, k)
            assert over["bytes_sent"] == sync["bytes_sent"] > 0, name
            assert over["reductions"] == sync["reductions"], name
            assert sync["async"] == 0, name
            assert over["async"] == steps * deferred_per_step, name


def _order_rank(overlap: bool) -> list:
    mesh = init_device_mesh("cpu", (WORLD,))
    net = _model(mesh, torch.float32, None)
    handle = enable(net, CommConfig(gradients="loco", overlap=overlap))
    # each unit's exchange has its own size: the codec's payload row for every rank
    unit_of = {w.payload_bytes * WORLD: f for f, w in handle.wire_choices.items()}
    assert len(unit_of) == UNITS
    log: list = []
    real = dist.all_to_all_single

    for i, block in enumerate(net.blocks):
        block.register_forward_pre_hook(lambda _m, args, i=i: (Marker.apply(args[0], log, i),))
    dist.all_to_all_single = logged_collective(real, unit_of, log)
    try:
        x, y = batch(0)
        loss = F.mse_loss(net(x), y)
        loss.backward()
        log.append(("backward_returned", None))
    finally:
        dist.all_to_all_single = real
    return log


def _overlap_violations(log: list) -> list[str]:
    """Each block i > 0: its exchange starts before block i-1 ends its backward compute, is
    waited for after that, and before block i-2's exchange starts (two in flight at most);
    every exchange is waited for before ``backward()`` returns."""
    problems = []
    for i in range(len(HIDDEN) - 1, 0, -1):
        unit, before = f"blocks.{i}", f"blocks.{i - 1}"
        start, wait = log.index(("start", unit)), log.index(("wait", unit))
        done = log.index(("bwd_done", i - 1))
        if not start < done:
            problems.append(f"{unit}'s exchange started after {before}'s backward compute")
        if not wait > done:
            problems.append(f"{unit}'s exchange waited for before {before}'s backward ended")
        if i > 1 and not wait < log.index(("start", f"blocks.{i - 2}")):
            problems.append(f"{unit}'s exchange still in flight when blocks.{i - 2}'s started")
    end = log.index(("backward_returned", None))
    for unit in {u for kind, u in log if kind == "start"}:
        if ("wait", unit) not in log[:end]:
            problems.append(f"{unit}'s exchange not waited for by the end of backward")
    return problems


def test_each_units_exchange_runs_behind_the_backward_of_the_unit_before():
    """With overlap every block's exchange runs behind the next block down's backward,
    two in flight at most, all done when ``backward()`` returns; without it, the same check names
    every block (so it can fail)."""
    for log in run_distributed(_order_rank, WORLD, True):
        assert _overlap_violations(log) == []
        assert sum(kind == "start" for kind, _ in log) == UNITS
    for log in run_distributed(_order_rank, WORLD, False):
        problems = _overlap_violations(log)
        assert len(problems) == len(HIDDEN) - 1, problems
