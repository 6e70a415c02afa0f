"""Test utilities shared by the test suite and the benchmarks (as torch keeps
its FSDP test helpers under ``torch.testing``): run a function on real multi-process gloo ranks.

Not imported by the library itself.
"""

from fsdp_ext.testing.multiprocess import RankError, RankTimeout, run_distributed

__all__ = ["RankError", "RankTimeout", "run_distributed"]
