"""fsdp_ext.integrations.accelerate against the real accelerate, 2 gloo ranks, tiny Qwen2-MoE.

Accelerate's CPU launcher picks DDP (``MULTI_CPU``) whatever the plugin says, so the test
forces its FSDP2 path after building the ``Accelerator``: ``state.distributed_type = FSDP``
and ``state.fsdp_plugin = plugin``, which is what accelerate itself sets on GPUs.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("accelerate")

import fsdp_ext
from tests.dist import run_distributed

WORLD = 2
STEPS = 10


def _qwen2_moe():
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    config = Qwen2MoeConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        intermediate_size=64,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
    )
    torch.manual_seed(0)
    return Qwen2MoeForCausalLM(config)


def _default():
    return fsdp_ext.GranularityPolicy()


def _tokens(rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randint(0, 64, (2, 12), generator=g)


def _accelerator(policy: str | None):
    from accelerate import Accelerator, FullyShardedDataParallelPlugin
    from accelerate.utils import DistributedType

    for key, value in {
        "RANK": dist.get_rank(),
        "WORLD_SIZE": WORLD,
        "LOCAL_RANK": dist.get_rank(),
        "LOCAL_WORLD_SIZE": WORLD,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500",
    }.items():
        os.environ[key] = str(value)
    kwargs = {"auto_wrap_policy": policy} if policy else {}
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, **kwargs)
    accelerator = Accelerator(cpu=True, fsdp_plugin=plugin)
    accelerator.state.distributed_type = DistributedType.FSDP  # see the module docstring
    accelerator.state.fsdp_plugin = plugin
    return accelerator


def _train(accelerator, model, optimizer) -> list[float]:
    losses = []
    for step in range(STEPS):
        tokens = _tokens(dist.get_rank(), step)
        loss = model(input_ids=tokens, labels=tokens).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _rank_runs() -> dict:
    from accelerate.state import AcceleratorState
    from torch.distributed.fsdp import FSDPModule

    from fsdp_ext.integrations.accelerate import prepare

    out = {}
    # accelerate's own FSDP2 wrap: one unit per decoder layer, embed, [norm, lm_head], root
    accelerator = _accelerator("TRANSFORMER_BASED_WRAP")
    model = _qwen2_moe()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    out["accelerate"] = _train(accelerator, model, optimizer)
    AcceleratorState._reset_state()

    # the adapter, with the plugin left on TRANSFORMER_BASED_WRAP and an optimizer built
    # before sharding (each of which made plain prepare fail)
    accelerator = _accelerator("TRANSFORMER_BASED_WRAP")
    model = _qwen2_moe()
    out["planned"] = sorted(u.fqn for u in fsdp_ext.plan_units(model, _default()).units)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = prepare(accelerator, model, optimizer)
    out["units"] = sorted(n for n, m in model.named_modules() if isinstance(m, FSDPModule))
    out["adapter"] = _train(accelerator, model, optimizer)
    AcceleratorState._reset_state()

    # a budget policy, optimizer from a factory: trains, and its units are the dry-run plan
    accelerator = _accelerator(None)
    model = _qwen2_moe()
    budget = fsdp_ext.GranularityPolicy(memory_budget_bytes=120_000)
    planned = [u.fqn for u in fsdp_ext.plan_units(model, budget).units]
    out["budget_plan_text"] = str(fsdp_ext.plan_units(model, budget))
    model, optimizer = prepare(
        accelerator,
        model,
        lambda params: torch.optim.AdamW(params, lr=1e-2),
        auto_wrap_policy=budget,
    )
    out["budget_planned"] = sorted(planned)
    out["budget_units"] = sorted(n for n, m in model.named_modules() if isinstance(m, FSDPModule))
    out["budget"] = _train(accelerator, model, optimizer)
    AcceleratorState._reset_state()

    # our policy handed to the plugin itself would be dropped by accelerate: refused
    accelerator = _accelerator(None)
    accelerator.state.fsdp_plugin.auto_wrap_policy = fsdp_ext.GranularityPolicy()
    try:
        prepare(accelerator, _qwen2_moe(), lambda p: torch.optim.SGD(p, lr=0.1))
    except ValueError as e:
        out["plugin_policy_error"] = str(e)
    AcceleratorState._reset_state()
    return out


@pytest.mark.slow  # ~2 min on the loaded 2-core box: four accelerators, 30 steps
def test_accelerate_adapter_matches_accelerate_and_honours_policies():
    runs = run_distributed(_rank_runs, WORLD, timeout=300)
    for run in runs:
        # bit-identical losses, 10 steps, on both ranks
        assert run["adapter"] == run["accelerate"], (run["adapter"], run["accelerate"])
        assert {"model.layers.0", "model.layers.1"} <= set(run["units"])
        assert run["units"] == sorted({"", *run["planned"]})
        assert run["budget_units"] == sorted({"", *run["budget_planned"]})
        assert run["budget_units"] != run["units"], run["budget_plan_text"]
        # other units, same arithmetic per parameter: the same losses
        assert run["budget"] == run["adapter"]
        assert "ignores every policy" in run["plugin_policy_error"]
