"""Print the wrap plan of any model factory, built on the meta device (no memory, no PG).

python -m fsdp_ext.wrap benchmarks.wrap_models:ModelWithFineGrainedBlock --threshold 12100
python -m fsdp_ext.wrap my_pkg.models:build --budget 2e9 --param-dtype bfloat16
"""

from __future__ import annotations

import argparse
import importlib
import sys

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

from fsdp_ext.wrap.plan import plan_units
from fsdp_ext.wrap.policy import GranularityPolicy


def _load_factory(spec: str):
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"factory must look like MODULE:FACTORY, got {spec!r}")
    target = importlib.import_module(module_name)
    for part in attr.split("."):
        target = getattr(target, part)
    if not callable(target):
        raise ValueError(f"{spec!r} is not callable")
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fsdp_ext.wrap", description=__doc__)
    parser.add_argument("factory", help="MODULE:FACTORY, called with no arguments")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--threshold", type=int, help="granularity threshold (params per layer)")
    group.add_argument("--budget", type=float, help="memory budget in bytes (e.g. 2e9)")
    parser.add_argument("--param-dtype", help="count bytes in this dtype, e.g. bfloat16")
    args = parser.parse_args(argv)
    factory = _load_factory(args.factory)
    with torch.device("meta"):
        model = factory()
    budget = None if args.budget is None else int(args.budget)
    policy = GranularityPolicy(args.threshold, memory_budget_bytes=budget)
    mp_policy = None
    if args.param_dtype:
        dtype = getattr(torch, args.param_dtype, None)
        if not isinstance(dtype, torch.dtype):
            parser.error(f"--param-dtype must name a torch dtype, got {args.param_dtype!r}")
        mp_policy = MixedPrecisionPolicy(param_dtype=dtype)
    print(plan_units(model, policy, mp_policy=mp_policy))
    return 0


if __name__ == "__main__":
    sys.exit(main())
