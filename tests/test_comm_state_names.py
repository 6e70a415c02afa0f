"""LoCo's error state is keyed by canonical parameter names, as DCP's state-dict helpers key
the model and optimizer: ``checkpoint_wrapper`` added (or removed) between a save and the
resume keeps the error buffers, and the resumed losses are the uninterrupted run's, bit for
bit. A real layout change still resets them, with a warning that names the parameters.

2 gloo ranks; each save is a real DCP checkpoint on disk (model, optimizer, LoCo handle).
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    apply_activation_checkpointing,
)
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh

import fsdp_ext
from fsdp_ext.testing import run_distributed

WORLD, DIM, STEPS, SAVE_AT = 2, 32, 4, 2
CONFIG = fsdp_ext.LoCoConfig(group_size=32)


class Block(nn.Module):
    def __init__(self, hidden: int = 64):
        super().__init__()
        self.up = nn.Linear(DIM, hidden)
        self.down = nn.Linear(hidden, DIM)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class Net(nn.Module):
    def __init__(self, hidden: int = 64):
        super().__init__()
        self.blocks = nn.ModuleList(Block(hidden) for _ in range(2))
        self.head = nn.Linear(DIM, DIM)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _job(wrapped: bool, hidden: int = 64):
    """Model, optimizer and LoCo handle, with every block in ``checkpoint_wrapper`` or not."""
    torch.manual_seed(0)
    net = Net(hidden)
    if wrapped:
        apply_activation_checkpointing(net, check_fn=lambda m: isinstance(m, Block))
    mesh = init_device_mesh("cpu", (WORLD,))
    fsdp_ext.shard_by_policy(net, auto_wrap_policy={Block}, mesh=mesh)
    handle = fsdp_ext.enable(net, fsdp_ext.CommConfig(gradients=CONFIG))
    return net, torch.optim.AdamW(net.parameters(), lr=1e-2), handle


def _steps(net, optim, start: int, stop: int) -> list[float]:
    losses = []
    for step in range(start, stop):
        g = torch.Generator().manual_seed(100 * step + dist.get_rank())
        x, y = torch.randn(8, DIM, generator=g), torch.randn(8, DIM, generator=g)
        loss = F.mse_loss(net(x), y)
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses


def _save(path: str, wrapped: bool) -> tuple[list[float], list[str]]:
    net, optim, handle = _job(wrapped)
    losses = _steps(net, optim, 0, SAVE_AT)
    model_sd, optim_sd = get_state_dict(net, optim)
    dcp.save({"model": model_sd, "optim": optim_sd, "comm": handle}, checkpoint_id=path)
    return losses, sorted(handle.units)


def _resume(path: str, wrapped: bool) -> tuple[list[float], list[str]]:
    lines = _Lines()
    logger = logging.getLogger("fsdp_ext.comm")
    logger.addHandler(lines)
    try:
        net, optim, handle = _job(wrapped)
        model_sd, optim_sd = get_state_dict(net, optim)
        state = {"model": model_sd, "optim": optim_sd, "comm": handle}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(net, optim, model_state_dict=model_sd, optim_state_dict=optim_sd)
        return _steps(net, optim, SAVE_AT, STEPS), lines.lines
    finally:
        logger.removeHandler(lines)


def _rank(tmp: str) -> dict:
    out: dict = {}
    net, optim, _ = _job(wrapped=False)
    out["straight"] = _steps(net, optim, 0, STEPS)
    for saved_wrapped in (False, True):
        path = f"{tmp}/saved_wrapped_{saved_wrapped}"
        head, units = _save(path, saved_wrapped)
        tail, warnings = _resume(path, not saved_wrapped)
        out[saved_wrapped] = {"losses": head + tail, "warnings": warnings, "units": units}
    # a real layout change: blocks of another width read the unwrapped checkpoint
    lines = _Lines()
    logging.getLogger("fsdp_ext.comm").addHandler(lines)
    _, _, handle = _job(wrapped=False, hidden=96)
    dcp.load({"comm": handle}, checkpoint_id=f"{tmp}/saved_wrapped_False")
    out["resized"] = lines.lines
    return out


def test_checkpoint_wrapper_between_save_and_resume_keeps_the_error_buffers(tmp_path):
    for r in run_distributed(_rank, WORLD, str(tmp_path), timeout=300):
        for saved_wrapped in (False, True):
            run = r[saved_wrapped]
            assert run["units"] == ["<root>", "blocks.0", "blocks.1"]  # canonical on both sides
            assert run["warnings"] == [], run["warnings"]
            assert run["losses"] == r["straight"], (saved_wrapped, run["losses"], r["straight"])
        (warning,) = r["resized"]
        assert "error buffers reset" in warning
        # the cause, named: which units, which parameters, which lengths
        assert "parameter layout of units blocks.0, blocks.1" in warning
        assert "blocks.0 (lengths: blocks.0.up.weight 1024 -> 1536" in warning
        assert "blocks.0.down.weight 1024 -> 1536" in warning
        assert "_checkpoint_wrapped_module" not in warning


def test_layout_changes_names_each_kind_of_change():
    from fsdp_ext.comm.register import layout_changes

    saved = {"a": [["a.w", 4], ["a.b", 2]], "b": [["b.w", 4]], "gone": [["gone.w", 1]]}
    now = {"a": [["a.w", 8], ["a.c", 2]], "b": [["b.w", 4]], "new": [["new.w", 1]]}
    text = layout_changes(["a", "gone", "new"], saved, now)
    assert text == (
        "a (parameters only in the checkpoint: a.b; parameters only in this run: a.c; "
        "lengths: a.w 4 -> 8); gone is only in the checkpoint; new is not in the checkpoint"
    )
    swapped = {"b": [["b.x", 4], ["b.w", 4]]}
    assert layout_changes(["b"], {"b": [["b.w", 4], ["b.x", 4]]}, swapped) == (
        "b (parameter order)"
    )
    assert "predates" in layout_changes(["a"], None, now)
