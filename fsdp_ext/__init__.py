"""fsdp-ext: plugins for PyTorch FSDP2 (``torch.distributed.fsdp.fully_shard``)."""

from fsdp_ext.comm import CommHandle as CommHandle
from fsdp_ext.comm import LoCoConfig as LoCoConfig
from fsdp_ext.comm import LoCoReduceScatter as LoCoReduceScatter
from fsdp_ext.comm import register_comm_hook as register_comm_hook
