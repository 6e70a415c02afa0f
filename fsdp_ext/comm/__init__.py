"""Compressed communication for FSDP2: gradient codecs on the reduce-scatter (4-/8-bit LoCo,
q4) and the HSDP all-reduce, an int8 parameter all-gather (qwZ), hpZ's check, and
``auto_config``, which picks among them.

The one entry point: ``handle = enable(model, CommConfig(gradients="loco", weights="int8",
hpz=True))``; ``handle.remove()`` undoes it.

The names (``"stock"``, ``"loco"``, ``"q4"``, ``"int8"``, ``"int8_forward"``) are the registry's
(:func:`gradient_names`, :func:`weight_names`): ``CommConfig``, the main job's ``--comm`` and
``auto`` all read them there. Every wire format is a :class:`Codec` (``fsdp_ext/comm/codec.py``)
with its own options dataclass, named in :data:`fsdp_ext.comm.registry.CODECS` or added with
:func:`register_codec`.
"""

from fsdp_ext.comm.absmax_codec import AbsmaxCodec, LoCoConfig, Q4Config
from fsdp_ext.comm.all_reduce_hook import LoCoAllReduceHook
from fsdp_ext.comm.auto import AutoDecision, auto_config, unit_sizes
from fsdp_ext.comm.codec import Codec, Feedback, WireChoice, choose_wire
from fsdp_ext.comm.reduce_scatter import LoCoReduceScatter
from fsdp_ext.comm.register import CommHandle
from fsdp_ext.comm.registry import (
    STOCK,
    gradient_names,
    make_codec,
    preset,
    register_codec,
    unregister_codec,
    weight_names,
)
from fsdp_ext.comm.stats import CommStats
from fsdp_ext.comm.weight_all_gather import QuantizedWeightAllGather, WeightGatherStats
from fsdp_ext.comm.weight_config import WeightQuantConfig
from fsdp_ext.comm.weight_register import WeightGatherHandle, register_weight_all_gather
from fsdp_ext.comm.zeropp import CommConfig, enable

__all__ = [
    "STOCK",
    "AbsmaxCodec",
    "AutoDecision",
    "Codec",
    "CommConfig",
    "CommHandle",
    "CommStats",
    "Feedback",
    "LoCoAllReduceHook",
    "LoCoConfig",
    "LoCoReduceScatter",
    "Q4Config",
    "QuantizedWeightAllGather",
    "WeightGatherHandle",
    "WeightGatherStats",
    "WeightQuantConfig",
    "WireChoice",
    "auto_config",
    "choose_wire",
    "enable",
    "gradient_names",
    "make_codec",
    "preset",
    "register_codec",
    "register_weight_all_gather",
    "unit_sizes",
    "unregister_codec",
    "weight_names",
]
