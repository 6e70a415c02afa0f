"""Compressed communication for FSDP2: 4-/8-bit LoCo reduce-scatter and HSDP hook, int8
parameter all-gather (qwZ), and ``auto_config``, which picks among them.

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
from fsdp_ext.comm.weight_config import QuantizedAllGather
from fsdp_ext.comm.weight_register import WeightGatherHandle, register_weight_all_gather

__all__ = [
    "AbsmaxCodec",
    "AutoDecision",
    "Codec",
    "CommHandle",
    "CommStats",
    "Feedback",
    "LoCoAllReduceHook",
    "LoCoConfig",
    "LoCoReduceScatter",
    "QuantizedAllGather",
    "QuantizedWeightAllGather",
    "WeightGatherHandle",
    "WeightGatherStats",
    "WireChoice",
    "auto_config",
    "choose_wire",
    "make_codec",
    "register_codec",
    "register_comm_hook",
    "register_weight_all_gather",
    "unit_sizes",
]
