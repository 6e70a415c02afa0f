"""Which transformer layer a state-dict key belongs to.

The planner keeps a layer's replicated items on one rank and the writer puts each layer in
its own file, so a reader that wants one layer (or a human with ``inspect``) finds it in
few files. Optimizer keys embed the parameter's fqn, so they land with their layer.
"""

from __future__ import annotations

import re
from collections.abc import Callable

LayerKey = Callable[[str], "str | None"]

_LAYER = re.compile(r"(?:^|\.)((?:layers|blocks|h)\.\d+)\.")


def default_layer_key(fqn: str) -> str | None:
    """``"model.layers.3.attn.wq.weight"`` -> ``"layers.3"``; ``None`` outside a layer.

    Recognises the ``layers.N.`` (Llama, torchtitan), ``blocks.N.`` and ``h.N.`` (GPT-2)
    conventions anywhere in the key, so optimizer state follows its parameter.
    """
    match = _LAYER.search(fqn)
    return match.group(1) if match else None


def layer_of(layer_key: LayerKey | None, fqn: str) -> str | None:
    """``layer_key(fqn)``, checked: a layer id must be a str (or None, outside a layer)."""
    if layer_key is None:
        return None
    layer = layer_key(fqn)
    if layer is not None and not isinstance(layer, str):
        raise TypeError(
            f"layer_key must return a str layer id or None; it returned {layer!r} "
            f"({type(layer).__name__}) for {fqn!r}"
        )
    return layer
