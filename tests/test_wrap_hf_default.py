"""The default wrap on HF decoder LMs (built from configs on the meta device, nothing
downloaded): one unit per decoder layer, never a unit for a lone norm, embedding or head.

Such a unit costs its hooks, three collectives' latency and a second all-gather of its bytes
every step, and saves nothing but memory the default does not budget for: a tiny
``MixtralForCausalLM`` on 4 ranks ran 136/109/123 ms per step with the old default (embedding,
each layer, the final norm alone, the output layer) against 85/73/99 per decoder layer.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fsdp_ext
from tests.hf_models import TINY_DECODER

pytest.importorskip("transformers")

NORMS = (nn.LayerNorm, nn.RMSNorm)


def _models():
    from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

    common = dict(TINY_DECODER, num_hidden_layers=3, intermediate_size=64)
    yield "llama", LlamaForCausalLM(LlamaConfig(**common))
    yield (
        "mixtral",
        MixtralForCausalLM(MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2)),
    )


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, NORMS) or type(module).__name__.endswith("RMSNorm")


@pytest.mark.parametrize("world", [4])
def test_hf_decoders_get_one_unit_per_layer_and_no_norm_unit(world):
    with torch.device("meta"):
        models = list(_models())
    for name, model in models:
        plan = fsdp_ext.plan_units(model, fsdp_ext.GranularityPolicy(), world_size=world)
        assert [u.fqn for u in plan.units] == ["", *(f"model.layers.{i}" for i in range(3))], name
        layer = type(model.model.layers[0])
        per_layer = fsdp_ext.plan_units(model, {layer}, world_size=world)
        assert [u.fqn for u in per_layer.units] == [u.fqn for u in plan.units], name
        # no unit is made only of norms; the root keeps embedding, final norm and head
        for group in plan.modules:
            assert not all(_is_norm(m) for m in group), (name, group)
        root_params = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
        assert plan.units[0].numel == sum(
            p.numel() for n, p in model.named_parameters() if n in root_params
        )
        # the last layer stays gathered after forward: one all-gather fewer, same peak
        assert plan.reshard_after_forward == [None, None, False], name
        assert plan.peak_bytes <= per_layer.peak_bytes, name
