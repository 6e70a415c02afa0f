"""Several optimizer parameter groups through the accelerate adapter, with LoCo on.

``prepare`` takes an optimizer built before sharding and points each of its param groups
at the sharded parameters of the same names (its lr and weight decay kept), then undoes
accelerate's re-mapping by ``data_ptr``, which confuses empty shards (a 1-row gate has
none on rank 1). Checked on 2 gloo ranks against a factory that builds the same groups over
the sharded parameters: the same losses bit for bit, every group holding exactly its
parameters once, and the frozen group (lr 0, no decay) unchanged after the steps.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

pytest.importorskip("accelerate")

import fsdp_ext
from fsdp_ext.testing import run_distributed
from tests.hf_models import set_launch_env

WORLD, STEPS = 2, 3


class _Gated(nn.Module):
    """Two blocks and a 1-row gate (an empty shard on rank 1, as Qwen2-MoE's
    ``shared_expert_gate``)."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(32, 32) for _ in range(2))
        self.gate = nn.Linear(32, 1)

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x * torch.sigmoid(self.gate(x))


def _groups(named: list[tuple[str, nn.Parameter]]) -> list[dict]:
    """Weights with decay at lr 1e-2; biases without; the gate frozen at lr 0."""
    decay = [p for n, p in named if n.endswith("weight") and not n.startswith("gate")]
    no_decay = [p for n, p in named if n.endswith("bias") and not n.startswith("gate")]
    gate = [p for n, p in named if n.startswith("gate")]
    return [
        {"params": decay, "lr": 1e-2, "weight_decay": 0.1},
        {"params": no_decay, "lr": 3e-2, "weight_decay": 0.0},
        {"params": gate, "lr": 0.0, "weight_decay": 0.0},
    ]


def _run(built_before: bool) -> dict:
    from accelerate import Accelerator, FullyShardedDataParallelPlugin
    from accelerate.state import AcceleratorState

    from fsdp_ext.integrations.accelerate import keep_fsdp_on_cpu, prepare

    set_launch_env(WORLD)
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
    accelerator = Accelerator(cpu=True, fsdp_plugin=plugin)
    keep_fsdp_on_cpu(accelerator, plugin)
    torch.manual_seed(0)
    model = _Gated()
    names = [n for n, _ in model.named_parameters()]

    def factory(params):
        return torch.optim.AdamW(_groups(list(zip(names, params, strict=True))))

    optimizer = torch.optim.AdamW(_groups(list(model.named_parameters())))
    optimizer = optimizer if built_before else factory
    loco = fsdp_ext.LoCoConfig(bits=4, group_size=32)
    comm = fsdp_ext.CommConfig(gradients=loco)
    model, optimizer, handle = prepare(accelerator, model, optimizer, comm=comm)
    by_id = {id(p): n for n, p in model.named_parameters()}
    held = [[by_id.get(id(p), "?") for p in g["params"]] for g in optimizer.param_groups]
    hyper = [(g["lr"], g["weight_decay"]) for g in optimizer.param_groups]
    gate_before = [p.to_local().clone() for p in model.gate.parameters()]
    losses = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(10 * step + dist.get_rank())
        loss = model(torch.randn(4, 32, generator=g)).square().mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    gate_after = [p.to_local() for p in model.gate.parameters()]
    out = {
        "losses": losses,
        "held": held,
        "hyper": hyper,
        "gate_frozen": all(torch.equal(a, b) for a, b in zip(gate_before, gate_after, strict=True)),
        "layers": [p.to_local().clone() for p in model.layers.parameters()],
        "loco_sent": handle.stats.bytes_sent,
    }
    AcceleratorState._reset_state(reset_partial_state=True)
    return out


def _rank() -> dict:
    return {"before": _run(True), "factory": _run(False)}


def test_param_groups_carry_over_to_the_sharded_parameters_with_loco(monkeypatch):
    monkeypatch.setenv("FSDP_EXT_DEFAULT_MESH_ON_CUDA", "0")  # accelerate's own mesh
    for r in run_distributed(_rank, WORLD, timeout=300):
        before, factory = r["before"], r["factory"]
        assert before["held"] == [
            ["layers.0.weight", "layers.1.weight"],
            ["layers.0.bias", "layers.1.bias"],
            ["gate.weight", "gate.bias"],
        ]
        assert before["held"] == factory["held"]
        assert before["hyper"] == factory["hyper"] == [(1e-2, 0.1), (3e-2, 0.0), (0.0, 0.0)]
        assert before["loco_sent"] > 0
        assert before["losses"] == factory["losses"]
        pairs = zip(before["layers"], factory["layers"], strict=True)
        assert all(torch.equal(a, b) for a, b in pairs)
        assert before["gate_frozen"] and factory["gate_frozen"]
