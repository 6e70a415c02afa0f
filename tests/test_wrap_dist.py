"""fsdp_ext.shard_by_policy on 2 gloo ranks: loss parity, idle experts, HF MoE models."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp.wrap import CustomPolicy, ModuleWrapPolicy

import fsdp_ext
from benchmarks.wrap_models import (
    DecoderLayer,
    FineMoE,
    FineMoEConfig,
    MLPBlock,
    ModelWithFineGrainedBlock,
    RMSNorm,
)
from fsdp_ext.testing import WireCounter, run_distributed
from tests.hf_models import TINY_DECODER, tiny_qwen2_moe_config

WORLD = 2


def _is_param_leaf(module: torch.nn.Module) -> bool:
    return not any(True for _ in module.children()) and any(
        True for _ in module.parameters(recurse=False)
    )


# ------------------------------------------------ DeepSpeed model: identical losses


def _deepspeed_batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, 128, generator=g), torch.randint(0, 128, (4,), generator=g)


def _train_deepspeed_model(steps: int) -> tuple[dict[str, list[float]], dict[str, int]]:
    mesh = init_device_mesh("cpu", (WORLD,))
    counter = WireCounter().open()  # this rank's process only
    policies = {
        "per_module": _is_param_leaf,
        "granularity_100": fsdp_ext.GranularityPolicy(100),
        "granularity_12100": fsdp_ext.GranularityPolicy(12100),
        "granularity_10M": fsdp_ext.GranularityPolicy(10_000_000),
        "module_wrap": ModuleWrapPolicy({MLPBlock}),
        # A CustomPolicy dict is passed to that module's fully_shard call.
        "custom_no_reshard": CustomPolicy(
            lambda m: {"reshard_after_forward": False} if isinstance(m, MLPBlock) else False
        ),
    }
    losses: dict[str, list[float]] = {}
    gathers: dict[str, int] = {}
    for name, policy in policies.items():
        torch.manual_seed(0)
        model = fsdp_ext.shard_by_policy(
            ModelWithFineGrainedBlock(), auto_wrap_policy=policy, mesh=mesh
        )
        optim = torch.optim.Adam(model.parameters(), lr=1e-3)
        losses[name] = []
        before = counter.calls.get("all_gather", 0)
        for step in range(steps):
            x, y = _deepspeed_batch(dist.get_rank(), step)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optim.step()
            optim.zero_grad()
            losses[name].append(loss.item())
        gathers[name] = (counter.calls.get("all_gather", 0) - before) // steps
    return losses, gathers


def test_deepspeed_model_losses_identical_to_per_module_wrap():
    steps = 4
    results = run_distributed(_train_deepspeed_model, WORLD, steps, timeout=240)
    per_rank = [losses for losses, _ in results]
    for losses in per_rank:
        for name, values in losses.items():
            assert values == losses["per_module"], name
    # Root (the coarse Linears) gathers once; 16 MLPBlocks gather in forward and backward,
    # or only in forward when the CustomPolicy turned their resharding off.
    gathers = results[0][1]
    assert gathers["module_wrap"] == 1 + 2 * 16
    assert gathers["custom_no_reshard"] == 1 + 16
    # And the sharded run matches one process training on both ranks' data.
    torch.manual_seed(0)
    ref = ModelWithFineGrainedBlock()
    optim = torch.optim.Adam(ref.parameters(), lr=1e-3)
    for step in range(steps):
        rank_losses = [
            F.cross_entropy(ref(x), y)
            for x, y in map(lambda r: _deepspeed_batch(r, step), range(WORLD))
        ]
        torch.stack(rank_losses).mean().backward()
        optim.step()
        optim.zero_grad()
        for r in range(WORLD):
            torch.testing.assert_close(
                per_rank[r]["per_module"][step], rank_losses[r].item(), rtol=1e-5, atol=1e-6
            )


# ------------------------------------------------ idle experts: no hang, zero grads

_IDLE_CFG = FineMoEConfig(
    vocab_size=32,
    dim=16,
    n_layers=1,
    n_heads=2,
    num_experts=8,
    expert_hidden=8,
    top_k=1,
    shared_hidden=8,
    skip_idle_experts=True,
)


def _idle_tokens(rank: int) -> torch.Tensor:
    return torch.randint(0, 32, (1, 5), generator=torch.Generator().manual_seed(7 + rank))


def _idle_experts_rank(native: bool, threshold: int | None) -> dict:
    import fsdp_ext.wrap.apply as apply

    apply.NATIVE_UNUSED_PARAM_REDUCE_SCATTER = native
    mesh = init_device_mesh("cpu", (WORLD,))
    torch.manual_seed(0)
    model = FineMoE(_IDLE_CFG)
    hits = [0] * _IDLE_CFG.num_experts
    for index, expert in enumerate(model.layers[0].mlp.experts):
        expert.register_forward_pre_hook(lambda m, a, i=index: hits.__setitem__(i, hits[i] + 1))
    policy = fsdp_ext.GranularityPolicy(threshold)
    units = [u.fqn for u in fsdp_ext.plan_units(model, policy).units]
    fsdp_ext.shard_by_policy(model, auto_wrap_policy=policy, mesh=mesh)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    tokens = _idle_tokens(dist.get_rank())
    grads, losses, first_step_hits = None, [], None
    for _ in range(3):
        loss = F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
        loss.backward()
        if grads is None:
            first_step_hits = list(hits)
            grads = {
                n: None if p.grad is None else p.grad.full_tensor()
                for n, p in model.named_parameters()
            }
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return {"units": units, "hits": first_step_hits, "grads": grads, "losses": losses}


def _reference_first_grads() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    ref = FineMoE(_IDLE_CFG)
    losses = []
    for r in range(WORLD):
        tokens = _idle_tokens(r)
        losses.append(F.cross_entropy(ref(tokens).flatten(0, 1), tokens.flatten()))
    torch.stack(losses).mean().backward()
    return {n: torch.zeros_like(p) if p.grad is None else p.grad for n, p in ref.named_parameters()}


def test_idle_experts_train_without_hang_and_get_zero_grads():
    from fsdp_ext.wrap.apply import NATIVE_UNUSED_PARAM_REDUCE_SCATTER

    ref = _reference_first_grads()
    # The fallback hook always; torch's own flag where this torch has it.
    for native in sorted({False, NATIVE_UNUSED_PARAM_REDUCE_SCATTER}):
        for threshold in (None, 0):
            ranks = run_distributed(_idle_experts_rank, WORLD, native, threshold, timeout=120)
            # The MoE block is one unit (alone, or inside its decoder layer).
            assert not any(u.startswith("layers.0.mlp.") for u in ranks[0]["units"])
            assert ("layers.0.mlp" in ranks[0]["units"]) == (threshold == 0)
            hits = [torch.tensor(r["hits"]) > 0 for r in ranks]
            one_rank_only = [e for e in range(8) if hits[0][e] != hits[1][e]]
            idle_everywhere = [e for e in range(8) if not hits[0][e] and not hits[1][e]]
            assert one_rank_only and idle_everywhere, hits
            for r in ranks:
                for name, want in ref.items():
                    got = r["grads"][name]
                    assert got is not None, f"{name} has no gradient (native={native})"
                    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
                for e in idle_everywhere:
                    for p in ("gate_proj", "up_proj", "down_proj"):
                        got = r["grads"][f"layers.0.mlp.experts.{e}.{p}.weight"]
                        assert torch.count_nonzero(got) == 0
                assert all(torch.isfinite(torch.tensor(r["losses"])))
            for e in one_rank_only:
                assert (
                    torch.count_nonzero(
                        ranks[0]["grads"][f"layers.0.mlp.experts.{e}.down_proj.weight"]
                    )
                    > 0
                )


# ------------------------------------------------ HF transformers MoE models


def _hf_models():
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen2MoeForCausalLM

    common = dict(TINY_DECODER, num_hidden_layers=2)
    qwen = tiny_qwen2_moe_config()
    mixtral = MixtralConfig(
        **common, intermediate_size=16, num_local_experts=4, num_experts_per_tok=2
    )
    return {"qwen2_moe": (Qwen2MoeForCausalLM, qwen), "mixtral": (MixtralForCausalLM, mixtral)}


def _hf_tokens(rank: int, step: int) -> torch.Tensor:
    return torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(50 * step + rank))


def _train_hf_rank(steps: int) -> dict:
    mesh = init_device_mesh("cpu", (WORLD,))
    out = {}
    for name, (cls, config) in _hf_models().items():
        torch.manual_seed(0)
        model = cls(config)
        reference = copy.deepcopy(model)
        policy = fsdp_ext.GranularityPolicy()
        plan = fsdp_ext.plan_units(model, policy)
        fsdp_ext.shard_by_policy(model, auto_wrap_policy=policy, mesh=mesh)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
        ref_optim = torch.optim.AdamW(reference.parameters(), lr=1e-3)
        losses, ref_losses = [], []
        for step in range(steps):
            tokens = _hf_tokens(dist.get_rank(), step)
            loss = model(input_ids=tokens, labels=tokens).loss
            loss.backward()
            optim.step()
            optim.zero_grad()
            losses.append(loss.item())
            per_rank = [
                reference(input_ids=t, labels=t).loss
                for t in (_hf_tokens(r, step) for r in range(WORLD))
            ]
            torch.stack(per_rank).mean().backward()
            ref_optim.step()
            ref_optim.zero_grad()
            ref_losses.append(per_rank[dist.get_rank()].item())
        out[name] = {
            "units": [u.fqn for u in plan.units],
            "table": str(plan),
            "losses": losses,
            "ref_losses": ref_losses,
        }
    return out


@pytest.mark.slow  # HF's default policy per model: tests/test_wrap_hf_default.py (default run)
def test_hf_qwen2_moe_and_mixtral_plan_and_train_on_2_ranks():
    ranks = run_distributed(_train_hf_rank, WORLD, 3, timeout=300)
    for r in ranks:
        for name, result in r.items():
            units = result["units"]
            assert "model.layers.0" in units and "model.layers.1" in units, (name, units)
            assert not any(".mlp." in u for u in units), (name, units)
            assert len(result["losses"]) == 3
            torch.testing.assert_close(result["losses"], result["ref_losses"], rtol=1e-4, atol=1e-5)
    assert ranks[0]["qwen2_moe"]["losses"] != ranks[1]["qwen2_moe"]["losses"]


# ------------------------------------------------ leaf vs block: where the last bits go


def _leaf_cfg(fused_norm: bool) -> FineMoEConfig:
    return FineMoEConfig(
        vocab_size=64,
        dim=16,
        n_layers=2,
        n_heads=2,
        num_experts=4,
        expert_hidden=8,
        top_k=2,
        shared_hidden=8,
        fused_norm=fused_norm,
    )


class _SumGradsHere(torch.autograd.Function):
    """Identity whose backward node sums its output's gradients first, as FSDP2's
    ``RegisterPostBackwardFunction`` does for a unit's inputs."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


class _GroupedInputRMSNorm(RMSNorm):
    def __init__(self, dim: int):
        super().__init__(dim, fused=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(_SumGradsHere.apply(x))


def _leaf_and_block_rank(fused_norm: bool, group_norm_inputs: bool, steps: int) -> dict:
    mesh = init_device_mesh("cpu", (WORLD,))
    cfg = _leaf_cfg(fused_norm)
    out = {}
    for name, policy in (("block", {DecoderLayer}), ("leaf", _is_param_leaf)):
        torch.manual_seed(0)
        model = FineMoE(cfg)
        if group_norm_inputs:
            for layer in model.layers:
                layer.input_layernorm = _GroupedInputRMSNorm(cfg.dim)
                layer.post_attention_layernorm = _GroupedInputRMSNorm(cfg.dim)
        fsdp_ext.shard_by_policy(model, auto_wrap_policy=policy, mesh=mesh)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses, grads = [], {}
        for step in range(steps):
            tokens = _hf_tokens(dist.get_rank(), step)[:, :9]
            loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
            loss.backward()
            if step == 0:
                grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
            optim.step()
            optim.zero_grad()
            losses.append(loss.item())
        out[name] = {"losses": losses, "grads": grads}
    return out


def test_leaf_differs_from_block_only_by_the_gradient_sums_at_norm_inputs():
    """Leaf's last-bit difference from block is FSDP2's input node on each RMSNorm unit.

    The residual stream ``x`` gets three gradients: the residual add's and, inside the
    norm, ``x * rsqrt(..)``'s and ``x.pow(2)``'s. Block sums them in one buffer,
    ``(add + mul) + pow``; a norm unit's input node sums its two first,
    ``add + (mul + pow)``. Grouping them alike in both wraps makes leaf bit-identical.
    """
    plain = run_distributed(_leaf_and_block_rank, WORLD, False, False, 1, timeout=120)
    last = f"layers.{_leaf_cfg(False).n_layers - 1}."
    for r in plain:
        block, leaf = r["block"]["grads"], r["leaf"]["grads"]
        same = {n for n in block if torch.equal(block[n], leaf[n])}
        # Everything backward reaches before the last layer's residual stream is equal ...
        before = ["lm_head.weight", "norm.weight", f"{last}post_attention_layernorm.weight"]
        before += [n for n in block if n.startswith(f"{last}mlp.")]
        assert set(before) <= same, set(before) - same
        # ... and the first weight fed by that stream's gradient is not.
        assert f"{last}self_attn.o_proj.weight" not in same
    grouped = run_distributed(_leaf_and_block_rank, WORLD, False, True, 3, timeout=120)
    _assert_bit_identical(grouped)


def test_leaf_is_bit_identical_to_block_with_a_fused_norm():
    """With one backward node per norm (as fused GPU kernels have) nothing is left for
    FSDP2's input nodes to regroup: every wrap gives the same bits."""
    _assert_bit_identical(run_distributed(_leaf_and_block_rank, WORLD, True, False, 3, timeout=120))


def _assert_bit_identical(ranks: list[dict]) -> None:
    for r in ranks:
        assert r["leaf"]["losses"] == r["block"]["losses"]
        for n, g in r["block"]["grads"].items():
            assert torch.equal(r["leaf"]["grads"][n], g), n
