"""Test utilities shared by the test suite and the benchmarks (as torch keeps
its FSDP test helpers under ``torch.testing``): run a function on real multi-process gloo ranks,
count what a rank's collectives send (:class:`WireCounter`, the one wire-byte count of the
benchmarks), kernel launches and host syncs (``gpu_counters``), and DCP's stock planning
steps for simulated plans and its stock fsspec writer and reader (a benchmark's baseline).

Not imported by the library itself.
"""

from fsdp_ext._torch import create_write_items, dedup_save_plans, fsspec_writer_and_reader
from fsdp_ext.testing.collectives import (
    CountingAllGather,
    CountingReduceScatter,
    fsdp_units,
)
from fsdp_ext.testing.gpu_counters import HostSyncs, KernelLaunches
from fsdp_ext.testing.multiprocess import RankError, RankTimeout, run_distributed
from fsdp_ext.testing.wire import WireCounter, sent_bytes

__all__ = [
    "CountingAllGather",
    "CountingReduceScatter",
    "HostSyncs",
    "KernelLaunches",
    "RankError",
    "RankTimeout",
    "WireCounter",
    "create_write_items",
    "dedup_save_plans",
    "fsdp_units",
    "fsspec_writer_and_reader",
    "run_distributed",
    "sent_bytes",
]
