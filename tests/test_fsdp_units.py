"""One enumeration of FSDP units (``fsdp_ext._torch.fsdp_units``), used by LoCo, qwZ, the
wrap planner and the counters: its order and content are FSDP's own, read from the root
state FSDP builds at its lazy init, on a model with nested units, a unit of two modules, a
unit without parameters, and the root."""

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard

from fsdp_ext._torch import fsdp_state_id, fsdp_units, param_groups, sharded_param
from fsdp_ext.testing import fsdp_units as public_fsdp_units
from fsdp_ext.testing import run_distributed
from tests.meshes import cpu_mesh


def _model():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 8),  # root's own
        nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 8))),  # "1" and "1.1"
        nn.ReLU(),  # "2": a unit without parameters
        nn.Linear(8, 8),  # "3"
        nn.LayerNorm(8),  # "4" and "5": one unit
        nn.Linear(8, 8),
    )


def _enumerate():
    mesh = cpu_mesh()
    model = _model()
    # shard in an order unlike the modules' (inner units before outer ones, as FSDP needs)
    fully_shard([model[4], model[5]], mesh=mesh)
    fully_shard(model[3], mesh=mesh)
    fully_shard(model[1][1], mesh=mesh)
    fully_shard(model[2], mesh=mesh)
    fully_shard(model[1], mesh=mesh)
    fully_shard(model, mesh=mesh)
    model(torch.randn(2, 8)).sum().backward()  # the root's lazy init orders its states
    # torch 2.11 lists a state of several modules once per module; 2.13-2.15 once
    fsdp_order = list({id(s): s for s in model._get_fsdp_state()._state_ctx.all_states}.values())
    units = fsdp_units(model)
    managed = [sorted(id(sharded_param(p)) for g in u.groups for p in g.fsdp_params) for u in units]
    return dict(
        names=[u.names for u in units],
        states=[fsdp_state_id(u.module) for u in units],
        fsdp_states=[id(s) for s in fsdp_order],
        groups=[id(g) for u in units for g in u.groups],
        fsdp_groups=[id(g) for s in fsdp_order for g in param_groups(s._modules[0])],
        every_module=[
            all(fsdp_state_id(m) == fsdp_state_id(u.module) for m in u.modules) for u in units
        ],
        counts=[len(m) for m in managed],
        public=[fqn for fqn, _ in public_fsdp_units(model)],
    )


def test_fsdp_units_are_fsdps_own_states_in_its_order():
    out = run_distributed(_enumerate, 2)[0]
    assert out["names"] == [("",), ("1",), ("1.1",), ("2",), ("3",), ("4", "5")]
    assert out["states"] == out["fsdp_states"]
    assert out["groups"] == out["fsdp_groups"]
    assert all(out["every_module"])
    # weight and bias each: root's Linear; 1's Linear; 1.1; none; 3; LayerNorm + Linear
    assert out["counts"] == [2, 2, 2, 0, 2, 4]
    assert out["public"] == ["", "1", "1.1", "3", "4"]  # the units that manage parameters
