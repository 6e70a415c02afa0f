"""fsdp_ext.name_straggler: who is slow, judged on each rank's own time, not on a mean;
and StragglerWatch's own time on 3 real gloo ranks, one of them with its CPU share cut from
outside (a cgroup quota). The lab run (a node's CPU cut, train.py) is
tests/test_lab_straggler.py.
"""

from __future__ import annotations

import os
import re
import statistics
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from fsdp_ext import Straggler, StragglerWatch, name_straggler
from fsdp_ext.straggler import thread_demand_s
from fsdp_ext.testing.multiprocess import run_distributed

NODES = [0, 0, 1, 1, 2, 2]  # 3 nodes x 2 ranks
STEP_S = [[1.0] * 10 for _ in NODES]


def test_a_steady_straggler_is_named_not_a_rank_with_one_slow_step():
    """Rank 1 had one 5 s step (a garbage collection, a page fault) and is fast otherwise;
    rank 4 is 3x slower on every step. A mean per rank would name rank 1 (0.59 s against
    0.3 s); its own median names rank 4."""
    own = [[0.1] * 10 for _ in NODES]
    own[1][3] = 5.0
    own[4] = [0.3] * 10
    found = name_straggler(own, STEP_S, NODES, first_step=11)
    assert found is not None
    assert (found.rank, found.node) == (4, 2)
    assert (found.first_step, found.last_step) == (11, 20)
    assert found.share == pytest.approx(0.3) and found.median_share == pytest.approx(0.1)
    assert found.ratio == pytest.approx(3.0)


def test_a_slow_node_of_two_ranks_does_not_raise_the_yardstick():
    """Both ranks of node 2 are slow. Against the mean rank (1.31 s) the slower, 1.96 s, is
    under 1.5x and nobody would be named; against the median rank (1.0 s) it is 1.96x."""
    own = [[1.0] * 5, [1.0] * 5, [1.0] * 5, [1.0] * 5, [1.9] * 5, [1.96] * 5]
    step = [[4.0] * 5 for _ in NODES]
    found = name_straggler(own, step, NODES, first_step=1)
    assert found is not None and (found.rank, found.node) == (5, 2)
    assert found.line() == (
        "straggler: rank 5 on node 2 (steps 1-5): its own work is 49% of its step time "
        "against 25% for the median rank (2.0x the median rank's own time)"
    )


def test_even_ranks_have_no_straggler():
    own = [[0.1 + 0.01 * ((r + s) % 3) for s in range(10)] for r in range(6)]
    assert name_straggler(own, STEP_S, NODES, first_step=1) is None


def test_bad_input_is_refused_naming_it():
    with pytest.raises(ValueError, match="own_s"):
        name_straggler([[]], [[]], [0], first_step=1)
    with pytest.raises(ValueError, match="factor must be > 1"):
        name_straggler([[1.0]], [[1.0]], [0], first_step=1, factor=1.0)
    assert isinstance(
        name_straggler([[1.0], [1.0], [9.0]], [[9.0]] * 3, [0, 1, 2], first_step=1), Straggler
    )


# ---------------------------------------------------------------- StragglerWatch, 3 gloo ranks
CPU_CGROUPS = Path("/sys/fs/cgroup/cpu")
STEPS, EVERY = 10, 5


def _spin(seconds: float) -> None:
    """A step's own work: CPU for ``seconds`` of this thread's CPU time."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def _watched_steps(handoff: str) -> dict:
    """Every rank: 10 steps of 10 ms of CPU and an all-reduce (the waits for the others);
    rank 2 writes its pid and waits until the test has cut its CPU share from outside."""
    rank = dist.get_rank()
    os.environ["GROUP_RANK"] = str(rank)  # one rank per node, as torchrun would say
    if rank == 2:
        Path(handoff, "pid").write_text(str(os.getpid()))
        while not Path(handoff, "cut").exists():
            time.sleep(0.01)
    dist.barrier()
    watch = StragglerWatch(every=EVERY)
    lines, own, wall = [], [], []
    for step in range(1, STEPS + 1):
        watch.begin()
        start, demand = time.perf_counter(), thread_demand_s()
        _spin(0.01)
        dist.all_reduce(torch.ones(8))
        own.append(thread_demand_s() - demand)
        wall.append(time.perf_counter() - start)
        if (line := watch.end(step)) is not None:
            lines.append(line)
    return {"lines": lines, "own": statistics.median(own), "wall": statistics.median(wall)}


@pytest.mark.skipif(
    not (CPU_CGROUPS / "cpu.cfs_quota_us").exists() or os.geteuid() != 0,
    reason=f"needs root and a cgroup v1 cpu controller at {CPU_CGROUPS} to cut a CPU share",
)
def test_a_rank_whose_cpu_share_is_cut_from_outside_is_named_every_window(tmp_path):
    """Rank 2's process goes into a cgroup with a tenth of one core (as a throttled host or a
    noisy neighbour would leave it), moved there by this test, not by the job. Its 10 ms of
    CPU per step then take about 100 ms, most of it waiting for a CPU while ready to run;
    ranks 0 and 1 spend that time blocked in the all-reduce, which is nobody's own work.
    Both windows name rank 2 on every rank. Taken from CPU time alone (without the wait for
    a CPU), rank 2's own time would equal the others' and nobody would be named."""
    group = CPU_CGROUPS / f"fsdp-ext-test-straggler-{os.getpid()}"
    group.mkdir()
    (group / "cpu.cfs_period_us").write_text("100000")
    (group / "cpu.cfs_quota_us").write_text("10000")

    def cut() -> None:
        pid, deadline = tmp_path / "pid", time.monotonic() + 120
        while not pid.exists():
            if time.monotonic() > deadline:  # rank 2 never started: the ranks' error says why
                return
            time.sleep(0.01)
        (group / "cgroup.procs").write_text(pid.read_text())
        (tmp_path / "cut").touch()

    cutter = threading.Thread(target=cut, daemon=True)
    cutter.start()
    try:
        results = run_distributed(_watched_steps, 3, str(tmp_path), timeout=120)
    finally:
        cutter.join(timeout=5)
        for pid in (group / "cgroup.procs").read_text().split():
            (CPU_CGROUPS / "cgroup.procs").write_text(pid)
        group.rmdir()
    named = [
        re.match(r"straggler: rank (\d) on node (\d) \(steps (\d+)-(\d+)\)", line)
        for line in results[0]["lines"]
    ]
    assert [m.groups() if m else None for m in named] == [
        ("2", "2", "1", "5"),
        ("2", "2", "6", "10"),
    ], results
    assert all(r["lines"] == results[0]["lines"] for r in results)
    # the fast ranks waited in the all-reduce for most of each step, and that is not theirs
    for fast in results[:2]:
        assert fast["own"] < 0.5 * fast["wall"], results
    assert results[2]["own"] > 3 * max(r["own"] for r in results[:2]), results
