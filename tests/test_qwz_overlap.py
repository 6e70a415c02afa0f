"""qwZ's overlap: the next unit's weight all-gather runs behind the current unit's compute.

``register_weight_all_gather(..., overlap=True)`` (the default) makes FSDP call the
quantised all-gather with ``async_op=True``: it encodes, starts the gloo gather and returns
a ``Work`` that decodes on ``wait()``. Each unit prefetches the next in forward (explicit
prefetch), and FSDP2's implicit backward prefetch gathers the unit before in backward.

- The async path gives the bits of the synchronous one (``overlap=False``): losses,
  parameters and byte counts, with backward quantised, forward only, and bf16 gathers.
- The order of events on each rank, recorded from outside the library (forward hooks,
  an autograd marker, and a wrapper around gloo's all-gather that logs each start and each
  ``wait()``): unit i+1's gather starts before unit i's forward computes and is waited for
  only after it, in unit i+1's pre-forward; in backward, unit i-1's gather starts before
  unit i's backward computes and is waited for only after it.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import fsdp_ext
from fsdp_ext.testing import run_distributed
from tests.overlap_cases import GROUP, HIDDEN, WORLD, Marker, batch, logged_collective, sharded

CONFIGS = {
    "backward": (fsdp_ext.WeightQuantConfig(group_size=GROUP), None),
    "forward_only": (fsdp_ext.WeightQuantConfig(group_size=GROUP, backward=False), None),
    "bf16": (fsdp_ext.WeightQuantConfig(group_size=GROUP), torch.bfloat16),
}


def _train_rank(name: str, overlap: bool, steps: int) -> dict:
    mesh = init_device_mesh("cpu", (WORLD,))
    config, mp = CONFIGS[name]
    net = sharded(mesh, mp)
    handle = fsdp_ext.register_weight_all_gather(net, config, overlap=overlap)
    optim = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for step in range(steps):
        x, y = batch(step)
        loss = F.mse_loss(net(x.to(mp or torch.float32)).float(), y)
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return {
        "losses": losses,
        "params": {n: p.full_tensor().detach().clone() for n, p in net.named_parameters()},
        "stats": handle.stats,
    }


@pytest.mark.parametrize("name", list(CONFIGS))
def test_async_gathers_equal_the_synchronous_ones_bit_for_bit(name):
    """Three SGD steps on 2 gloo ranks: losses, parameters and byte counts of the
    overlapped (async) gathers equal those of the synchronous path exactly."""
    sync = run_distributed(_train_rank, WORLD, name, False, 3)
    overlapped = run_distributed(_train_rank, WORLD, name, True, 3)
    for s, o in zip(sync, overlapped, strict=True):
        assert o["losses"] == s["losses"]
        for n, p in s["params"].items():
            assert torch.equal(o["params"][n], p), n
        assert o["stats"] == s["stats"]
        assert o["stats"].quantized_gathers > 0


def _order_rank(overlap: bool) -> list:
    mesh = init_device_mesh("cpu", (WORLD,))
    net = sharded(mesh)
    handle = fsdp_ext.register_weight_all_gather(
        net, fsdp_ext.WeightQuantConfig(group_size=GROUP), overlap=overlap
    )
    # each unit's gather has its own output size: the codec's payload row on every rank
    unit_of = {w.payload_bytes * WORLD: fqn for fqn, w in handle.wire_choices.items()}
    assert len(unit_of) == len(handle.units) and all(
        w.compressed for w in handle.wire_choices.values()
    )
    log: list = []
    name = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
    real = getattr(dist, name)

    for i, block in enumerate(net.blocks):
        # registered after FSDP's hooks: runs once the block's weights are gathered
        block.register_forward_pre_hook(
            lambda _m, args, i=i: (log.append(("fwd_begin", f"blocks.{i}")), None)[1]
        )
        block.register_forward_pre_hook(lambda _m, args, i=i: (Marker.apply(args[0], log, i),))
        block.register_forward_hook(lambda *_, i=i: log.append(("fwd_end", f"blocks.{i}")))
    setattr(dist, name, logged_collective(real, unit_of, log))
    try:
        x, y = batch(0)
        loss = F.mse_loss(net(x), y)
        log.append(("backward", None))
        loss.backward()
    finally:
        setattr(dist, name, real)
    return log


def _overlap_violations(log: list) -> list[str]:
    """What in ``log`` shows a gather that did not run behind the neighbouring unit's
    compute: forward, blocks.i+1 behind blocks.i; backward, blocks.i-1 behind blocks.i."""
    split = log.index(("backward", None))
    fwd, bwd = log[:split], log[split:]
    blocks = len(HIDDEN)
    problems = []
    for i in range(blocks - 1):
        nxt = f"blocks.{i + 1}"
        start, wait = fwd.index(("start", nxt)), fwd.index(("wait", nxt))
        if not start < fwd.index(("fwd_begin", f"blocks.{i}")):
            problems.append(f"forward: {nxt} gathered only after blocks.{i} began computing")
        if not wait > fwd.index(("fwd_end", f"blocks.{i}")):
            problems.append(f"forward: {nxt} waited for before blocks.{i} finished computing")
    for i in range(blocks - 1, 0, -1):
        prev = f"blocks.{i - 1}"
        start, wait = bwd.index(("start", prev)), bwd.index(("wait", prev))
        done = bwd.index(("bwd_done", i))
        if not start < done:
            problems.append(f"backward: {prev} gathered only after blocks.{i} computed")
        if not wait > done:
            problems.append(f"backward: {prev} waited for before blocks.{i} finished computing")
    return problems


def test_the_next_units_gather_runs_behind_this_units_compute():
    """With overlap (the default), every block's gather is started one unit ahead and
    waited for one unit later, forward and backward, on every rank; each block is gathered
    once per pass."""
    for log in run_distributed(_order_rank, WORLD, True):
        assert _overlap_violations(log) == []
        split = log.index(("backward", None))
        for i in range(len(HIDDEN)):
            assert log[:split].count(("start", f"blocks.{i}")) == 1
            assert log[split:].count(("start", f"blocks.{i}")) == 1


def test_without_overlap_the_order_check_sees_none():
    """``overlap=False``: every gather runs to its end where FSDP asks for it, and the
    same check names the forward and backward of every block (so it can fail)."""
    for log in run_distributed(_order_rank, WORLD, False):
        problems = _overlap_violations(log)
        assert any(p.startswith("forward") for p in problems)
        assert any(p.startswith("backward") for p in problems)
