"""Validated, elastic resume of LoCo error state through real DCP checkpoints on disk."""

import logging

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.fsdp import fully_shard

from fsdp_ext import CommConfig, LoCoConfig, enable
from fsdp_ext.testing import run_distributed
from tests.meshes import cpu_mesh

CONFIG = LoCoConfig(group_size=32, error_dtype=torch.int8)


def _model_and_handle(config, strict=False):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    fully_shard(model[0], mesh=cpu_mesh())
    fully_shard(model[2], mesh=cpu_mesh())
    fully_shard(model, mesh=cpu_mesh())
    return model, enable(model, CommConfig(gradients=config), strict=strict)


def _steps(model, start, count):
    for step in range(start, start + count):
        gen = torch.Generator().manual_seed(10 * step + dist.get_rank())
        x, y = torch.randn(8, 64, generator=gen), torch.randn(8, 64, generator=gen)
        nn.functional.mse_loss(model(x), y).backward()
    return [p.grad.full_tensor() for p in model.parameters()]


def _save(path):
    model, handle = _model_and_handle(CONFIG)
    _steps(model, 0, 3)
    dcp.save({"comm": handle}, checkpoint_id=path)
    return float(handle._units["0"].reduce_scatter.feedback.error.abs().max())


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _load_elsewhere(path):
    out = {}
    lines = _Lines()
    logging.getLogger("fsdp_ext.comm").addHandler(lines)
    model, handle = _model_and_handle(CONFIG)
    dcp.load({"comm": handle}, checkpoint_id=path)
    out["warnings"] = lines.lines
    fb = handle._units["0"].reduce_scatter.feedback
    out["fresh"] = fb.error is None and fb.reductions == 0
    grads = _steps(model, 3, 2)  # training continues
    out["finite"] = all(bool(torch.isfinite(g).all()) for g in grads)
    out["reductions_after"] = fb.reductions
    for name, config, strict in (
        ("strict", CONFIG, True),
        ("dtype", LoCoConfig(group_size=32, error_dtype=torch.float32), False),
        ("bits", LoCoConfig(group_size=32, bits=8), False),
    ):
        _, handle = _model_and_handle(config, strict=strict)
        with pytest.raises(ValueError) as exc:
            dcp.load({"comm": handle}, checkpoint_id=path)
        out[name] = str(exc.value)
    return out


@pytest.mark.slow
def test_other_world_size_resets_with_one_warning_strict_and_dtype_raise(tmp_path):
    path = str(tmp_path / "ckpt")
    saved = run_distributed(_save, 4, path)
    assert all(m > 0 for m in saved)  # there was error state to lose
    for out in run_distributed(_load_elsewhere, 2, path):
        assert len(out["warnings"]) == 1 and "\n" not in out["warnings"][0]
        assert "world_size 4 -> 2" in out["warnings"][0], out["warnings"]
        assert out["fresh"] and out["finite"] and out["reductions_after"] == 2
        assert "world_size 4 -> 2" in out["strict"] and "strict=True" in out["strict"]
        assert "error_dtype=torch.int8" in out["dtype"] and "torch.float32" in out["dtype"]
        assert "bits=4" in out["bits"] and "bits=8" in out["bits"]
