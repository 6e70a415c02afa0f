"""fsdp-ext: plugins for PyTorch FSDP2 (``torch.distributed.fsdp.fully_shard``)."""

from fsdp_ext.wrap import GranularityPolicy as GranularityPolicy
from fsdp_ext.wrap import WrapPlan as WrapPlan
from fsdp_ext.wrap import fully_shard as fully_shard
from fsdp_ext.wrap import plan_units as plan_units
