"""``fsdp_ext.shard_by_policy`` names torch's keywords itself (help and IDEs show them), covers
every keyword of the installed torch's ``fully_shard``, and hands each one to torch."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Shard

import fsdp_ext
from fsdp_ext._torch import group_reshard_after_forward, param_group
from fsdp_ext.testing import fsdp_units, run_distributed


def _keywords(fn) -> dict[str, inspect.Parameter]:
    return {
        name: p
        for name, p in inspect.signature(fn).parameters.items()
        if p.kind is inspect.Parameter.KEYWORD_ONLY
    }


def test_signature_covers_torch_fully_shard():
    ours, torch_kw = _keywords(fsdp_ext.shard_by_policy), _keywords(torch_fully_shard)
    assert set(torch_kw) <= set(ours), f"missing {sorted(set(torch_kw) - set(ours))}"
    # ours, plus keywords of newer releases that the installed torch lacks (2.11: dp_mesh_dims)
    newer = {"dp_mesh_dims"}
    assert {"auto_wrap_policy"} <= set(ours) - set(torch_kw) <= {"auto_wrap_policy", *newer}
    kinds = {p.kind for p in inspect.signature(fsdp_ext.shard_by_policy).parameters.values()}
    assert inspect.Parameter.VAR_KEYWORD not in kinds  # nothing hidden behind **kwargs
    assert all(p.default is None for p in ours.values())  # torch's default unless given
    doc = inspect.getdoc(fsdp_ext.shard_by_policy)
    assert all(name in doc for name in ours)


def test_unknown_keyword_is_refused_by_name():
    with pytest.raises(TypeError, match="reshard_after_froward"):
        fsdp_ext.shard_by_policy(nn.Linear(2, 2), reshard_after_froward=True)


def _keywords_reach_torch() -> dict:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8))
    model.register_parameter("unused", nn.Parameter(torch.zeros(4)))  # the root's own
    ignored = model.unused
    fsdp_ext.shard_by_policy(
        model,
        auto_wrap_policy={nn.Linear},
        mesh=mesh,
        reshard_after_forward=False,
        shard_placement_fn=lambda p: Shard(1) if p.dim() == 2 else None,
        mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16),
        offload_policy=CPUOffloadPolicy(pin_memory=False),
        ignored_params={ignored},
    )
    units = dict(fsdp_units(model))
    out = {
        "units": sorted(units),
        "weight_placement": [model[i].weight.placements for i in range(3)],
        "ignored_is_dtensor": isinstance(model.unused, DTensor),
        "bias_is_dtensor": isinstance(model[0].bias, DTensor),
    }
    seen = {}

    def record_dtype(module, args, output):
        seen.setdefault("dtype", output.dtype)

    model[0].register_forward_hook(record_dtype)
    model(torch.randn(2, 8)).float().sum().backward()
    out["forward_dtype"] = seen["dtype"]
    groups = [param_group(units[name]) for name in sorted(units)]
    out["reshard"] = [group_reshard_after_forward(g) for g in groups]
    out["offload"] = [isinstance(g.offload_policy, CPUOffloadPolicy) for g in groups]
    return out


def test_every_keyword_reaches_torch():
    for r in run_distributed(_keywords_reach_torch, 2):
        assert r["units"] == ["0", "1", "2"]
        assert all(p == (Shard(1),) for p in r["weight_placement"])  # shard_placement_fn
        assert r["bias_is_dtensor"] and not r["ignored_is_dtensor"]  # ignored_params
        assert r["forward_dtype"] == torch.bfloat16  # mp_policy
        assert r["reshard"] == [False, False, False]  # reshard_after_forward
        assert r["offload"] == [True, True, True]  # offload_policy
