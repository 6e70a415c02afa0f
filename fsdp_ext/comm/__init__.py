"""Compressed communication for FSDP2: 4-/8-bit LoCo reduce-scatter and HSDP hook, int8
parameter all-gather (qwZ), hpZ's check, and ``auto_config``, which picks among them.

The entry point: ``handle = enable(model, CommConfig(gradients="loco", weights="int8",
secondary_shards="node"))``; ``handle.remove()`` undoes it.

Every wire format is a :class:`Codec` (``fsdp_ext/comm/codec.py``), named in
:data:`fsdp_ext.comm.registry.CODECS` or added with :func:`register_codec`.
"""

from fsdp_ext.comm.absmax_codec import AbsmaxCodec
from fsdp_ext.comm.all_reduce_hook import LoCoAllReduceHook
from fsdp_ext.comm.auto import AutoDecision, auto_config, unit_sizes
from fsdp_ext.comm.codec import Codec, Feedback, WireChoice, choose_wire
from fsdp_ext.comm.config import LoCoConfig
from fsdp_ext.comm.reduce_scatter import LoCoReduceScatter
from fsdp_ext.comm.register import CommHandle, register_comm_hook
from fsdp_ext.comm.registry import make_codec, register_codec
from fsdp_ext.comm.stats import CommStats
from fsdp_ext.comm.weight_all_gather import QuantizedWeightAllGather, WeightGatherStats
from fsdp_ext.comm.weight_config import WeightQuantConfig
from fsdp_ext.comm.weight_register import WeightGatherHandle, register_weight_all_gather
from fsdp_ext.comm.zeropp import CommConfig, enable

__all__ = [
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
    "QuantizedWeightAllGather",
    "WeightGatherHandle",
    "WeightGatherStats",
    "WeightQuantConfig",
    "WireChoice",
    "auto_config",
    "choose_wire",
    "enable",
    "make_codec",
    "register_codec",
    "register_comm_hook",
    "register_weight_all_gather",
    "unit_sizes",
]
