"""Compressed gradient communication for FSDP2: 4-/8-bit LoCo reduce-scatter and HSDP hook."""

from fsdp_ext.comm.all_reduce_hook import LoCoAllReduceHook
from fsdp_ext.comm.config import LoCoConfig
from fsdp_ext.comm.reduce_scatter import LoCoReduceScatter
from fsdp_ext.comm.register import CommHandle, register_comm_hook
from fsdp_ext.comm.stats import CommStats

__all__ = [
    "CommHandle",
    "CommStats",
    "LoCoAllReduceHook",
    "LoCoConfig",
    "LoCoReduceScatter",
    "register_comm_hook",
]
