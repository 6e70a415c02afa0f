"""Auto-wrap for FSDP2: granularity and FSDP1 policies, dry-run plans, ``shard_by_policy``, hpZ."""

from fsdp_ext.wrap.apply import check_wrap, shard_by_policy
from fsdp_ext.wrap.cost import CostModel, calibrate_cost_model
from fsdp_ext.wrap.measure import UnshardedBytesTracker
from fsdp_ext.wrap.node_reshard import node_local_reshard, resolve_reshard_after_forward
from fsdp_ext.wrap.plan import plan_units
from fsdp_ext.wrap.policy import GranularityPolicy
from fsdp_ext.wrap.units import Unit, WrapPlan

__all__ = [
    "CostModel",
    "GranularityPolicy",
    "Unit",
    "UnshardedBytesTracker",
    "WrapPlan",
    "calibrate_cost_model",
    "check_wrap",
    "node_local_reshard",
    "plan_units",
    "resolve_reshard_after_forward",
    "shard_by_policy",
]
