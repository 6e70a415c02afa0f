"""Auto-wrap for FSDP2: granularity and FSDP1 policies, dry-run plans, ``fully_shard``."""

from fsdp_ext.wrap.apply import check_wrap, fully_shard
from fsdp_ext.wrap.plan import Unit, WrapPlan, plan_units
from fsdp_ext.wrap.policy import GranularityPolicy

__all__ = ["GranularityPolicy", "Unit", "WrapPlan", "check_wrap", "fully_shard", "plan_units"]
