"""Our shard call against torch's own ``fully_shard`` per decoder layer, call for call.

On a tiny HF ``MixtralForCausalLM`` (built from a config, nothing downloaded) our default
plan is torch's per-layer units with the last layer kept gathered after forward. Sharded
that way by torch itself (``benchmarks/wrap_torch.py``, ``keep_last=True``), both paths must
put the same collectives with the same bytes on the wire, in the same order, register the
same hooks on the same modules and train to the same bits: any per-step work our path adds
would show here. Against the tutorial loop (every layer resharded) ours sends exactly one
all-gather fewer per step, the last layer's backward one.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import fsdp_ext
from fsdp_ext.testing import WireCounter, fsdp_units, run_distributed
from fsdp_ext.wrap.apply import NATIVE_UNUSED_PARAM_REDUCE_SCATTER

pytest.importorskip("transformers")

WORLD = 2
STEPS = 2
PATHS = ("ours", "torch_same_plan", "torch_tutorial")


class CallLog(WireCounter):
    """A WireCounter that also keeps each call, in order: (kind, bytes sent to peers)."""

    def __init__(self) -> None:
        super().__init__()
        self.log: list[tuple[str, int]] = []

    def _add(self, kind: str, ranks: list[int], to: dict[int, int]) -> None:
        super()._add(kind, ranks, to)
        me = dist.get_rank()
        self.log.append((kind, sum(b for r, b in to.items() if r != me)))


def _hooks(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """Per module: forward pre-, forward, backward pre- and backward hooks."""
    return {
        name: (
            len(m._forward_pre_hooks),
            len(m._forward_hooks),
            len(m._backward_pre_hooks),
            len(m._backward_hooks),
        )
        for name, m in model.named_modules()
    }


def _shard(path: str, model: torch.nn.Module, mesh) -> None:
    from benchmarks.wrap_torch import torch_per_layer

    if path == "ours":
        fsdp_ext.shard_by_policy(model, auto_wrap_policy=fsdp_ext.GranularityPolicy(), mesh=mesh)
    else:
        torch_per_layer(model, mesh, keep_last=path == "torch_same_plan")


def _rank() -> dict[str, dict]:
    from benchmarks.wrap import hf_model

    mesh = init_device_mesh("cpu", (WORLD,))
    out = {}
    for path in PATHS:
        torch.manual_seed(0)
        model = hf_model("mixtral_tiny")
        _shard(path, model, mesh)
        optim = torch.optim.SGD(model.parameters(), lr=1e-2)
        counter = CallLog().open()
        logs, losses = [], []
        try:
            for step in range(STEPS):
                g = torch.Generator().manual_seed(100 * step + dist.get_rank())
                tokens = torch.randint(0, 256, (2, 17), generator=g)
                counter.log = []
                logits = model(tokens[:, :-1], use_cache=False).logits
                loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
                loss.backward()
                optim.step()
                optim.zero_grad()
                logs.append(counter.log)
                losses.append(loss.item())
        finally:
            counter.close()
        out[path] = {
            "units": [fqn for fqn, _ in fsdp_units(model)],
            "hooks": _hooks(model),
            "logs": logs,
            "losses": losses,
        }
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, dict]]:
    return run_distributed(_rank, WORLD, timeout=240)


def test_ours_and_torch_per_layer_make_the_same_collectives_when_the_plans_are_equal(ranks):
    for rank in ranks:
        ours, torch_ = rank["ours"], rank["torch_same_plan"]
        for step, (a, b) in enumerate(zip(ours["logs"], torch_["logs"], strict=True)):
            assert a == b, f"step {step}: ours {a} vs torch {b}"
        assert ours["units"] == torch_["units"] == ["", "model.layers.0", "model.layers.1"]
        # root + layer 0 + layer 1 gathered in forward, layer 0 again in backward (layer 1
        # kept), one reduce-scatter per unit
        kinds = Counter(kind for kind, _ in ours["logs"][0])
        assert kinds == {"all_gather": 4, "reduce_scatter": 3}, kinds
        assert all(nbytes > 0 for _, nbytes in ours["logs"][0])
        want = dict(torch_["hooks"])
        if not NATIVE_UNUSED_PARAM_REDUCE_SCATTER:
            # torch 2.11's FSDP2 cannot reduce-scatter a parameter that got no gradient, so
            # each MoE block gets one forward hook that gives idle experts a zero gradient
            for name in ("model.layers.0.mlp", "model.layers.1.mlp"):
                pre, fwd, bpre, bwd = want[name]
                want[name] = (pre, fwd + 1, bpre, bwd)
        assert ours["hooks"] == want
        assert ours["losses"] == torch_["losses"]


def test_against_the_tutorial_loop_ours_saves_the_last_layers_backward_gather(ranks):
    for rank in ranks:
        ours, tutorial = rank["ours"], rank["torch_tutorial"]
        for a, b in zip(ours["logs"], tutorial["logs"], strict=True):
            assert not Counter(a) - Counter(b), f"ours {a} vs torch {b}"
            last_layer_gather = [c for c in a if c[0] == "all_gather"][2]  # root, 0, 1
            assert Counter(b) - Counter(a) == {last_layer_gather: 1}, f"ours {a} vs torch {b}"
        assert ours["units"] == tutorial["units"]
        assert ours["losses"] == tutorial["losses"]


def _timed_steps_on_each_rank(paces: list[list[float]], steps: int) -> int:
    from benchmarks.wrap import timed_steps

    return timed_steps(steps, paces[dist.get_rank()])


def test_a_fast_config_gets_enough_timed_steps_and_every_rank_the_same_count():
    """benchmarks/wrap.py --hf: a config whose steps take 70 ms is timed for at least
    HF_MIN_TIMED_S per path at the slowest rank's warm-up pace (5 s / 0.1 s = 50 steps, not
    rank 0's 5 / 0.05 = 100: the ranks must agree), a slow one keeps --hf-steps, and the count
    is capped."""
    from benchmarks.wrap import HF_MAX_STEPS, HF_MIN_TIMED_S

    assert HF_MIN_TIMED_S == 5.0
    fast = [[0.05, 0.05, 0.06], [0.1, 0.1, 0.2]]  # rank 1's median pace: 0.1 s
    assert run_distributed(_timed_steps_on_each_rank, 2, fast, 10) == [50, 50]
    slow = [[5.0, 4.0, 6.0], [5.5, 5.0, 6.0]]
    assert run_distributed(_timed_steps_on_each_rank, 2, slow, 10) == [10, 10]
    tiny = [[1e-4] * 3, [1e-4] * 3]
    assert run_distributed(_timed_steps_on_each_rank, 2, tiny, 10) == [HF_MAX_STEPS] * 2
