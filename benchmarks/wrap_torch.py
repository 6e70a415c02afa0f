"""The baseline of the wrap benchmarks: torch's own ``fully_shard``, as users write it.

A user who does not take ``fsdp_ext.shard_by_policy`` writes the PyTorch tutorials' loop, one
``fully_shard`` per decoder layer and then one on the root (torchtitan's ``apply_fsdp`` is
the same loop). ``keep_last=True`` is torchtitan's former default: the last layer stays
gathered after forward (its backward comes next), which is the plan
``GranularityPolicy()`` makes on HF decoders, so the two paths can be compared call for
call. Nothing here imports our wrap code.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

__all__ = ["decoder_layers", "torch_per_layer"]


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """An HF causal LM's decoder layers (``model.model.layers``)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, nn.ModuleList) or not len(layers):
        raise ValueError(
            f"model must be an HF causal LM with decoder layers at model.model.layers, got "
            f"{type(model).__name__}"
        )
    return list(layers)


def torch_per_layer(model: nn.Module, mesh: DeviceMesh, *, keep_last: bool = False) -> nn.Module:
    """``fully_shard`` each decoder layer, then the root, with torch's defaults;
    ``keep_last``: the last layer with ``reshard_after_forward=False``."""
    layers = decoder_layers(model)
    for index, layer in enumerate(layers):
        if keep_last and index == len(layers) - 1:
            fully_shard(layer, mesh=mesh, reshard_after_forward=False)
        else:
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model
