"""Naming a straggler: the rank whose own work per step takes far longer than the others'.

In synchronous data parallelism every rank's step lasts as long as the slowest rank's, so
step times alone cannot say who is slow: the fast ranks spend the difference waiting in
the collectives. What differs is each rank's *own* time. ``StragglerWatch`` takes it from
the kernel's accounting of the training thread (``/proc/thread-self/schedstat``): the time
it ran plus the time it was ready to run and waited for a CPU, over the whole step. A slower
CPU shows in the first, a CPU share cut by a cgroup quota or a noisy neighbour in the
second, and time blocked in a collective (waiting for the others) in neither, wherever in
the step it falls: forward, backward, the optimizer, an MoE layer's own all-reduce. Every
``every`` steps one small all-gather (two floats per step and the node index, per rank)
brings every rank's times to all, and ``name_straggler`` judges them on each rank's own
median, against the median rank: a single slow step (a garbage collection, a page fault) is
no straggler, and a slow node of two ranks does not drag the yardstick up with it, as a mean
would. Where schedstat cannot be read (a kernel without ``CONFIG_SCHED_INFO``, not Linux),
the thread's CPU time alone is used, which misses a cut share.

This times the CPU's work. On CUDA the step's own work is the GPU's, which the CPU thread
waits for in ways that count here as run time; it is not measured there.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["Straggler", "StragglerWatch", "name_straggler", "thread_demand_s"]

DEFAULT_FACTOR = 1.5  # a rank whose own time is 1.5x the median rank's is named


@dataclass(frozen=True)
class Straggler:
    """The rank named, its node, and how its own time compares."""

    rank: int
    node: int
    share: float  # its own time over its step time (medians over the window)
    median_share: float  # the same for the median rank
    ratio: float  # its own time over the median rank's own time
    first_step: int
    last_step: int

    def line(self) -> str:
        """The one line the job prints."""
        return (
            f"straggler: rank {self.rank} on node {self.node} (steps {self.first_step}-"
            f"{self.last_step}): its own work is {self.share:.0%} of its step time against "
            f"{self.median_share:.0%} for the median rank ({self.ratio:.1f}x the median rank's "
            "own time)"
        )


def name_straggler(
    own_s: Sequence[Sequence[float]],
    step_s: Sequence[Sequence[float]],
    nodes: Sequence[int],
    *,
    first_step: int,
    factor: float = DEFAULT_FACTOR,
) -> Straggler | None:
    """The rank whose median own time (``own_s[rank]``: seconds per step of the window) is
    at least ``factor`` times the median rank's, or None. ``step_s[rank]``: that rank's step
    times, for the share; ``nodes[rank]``: its node."""
    if not own_s or any(len(times) == 0 for times in own_s):
        raise ValueError("own_s: give every rank's own times for at least one step")
    if factor <= 1:
        raise ValueError(f"factor must be > 1, got {factor!r}")
    own = [statistics.median(times) for times in own_s]
    steps = [statistics.median(times) for times in step_s]
    yardstick = statistics.median(own)
    slowest = max(range(len(own)), key=own.__getitem__)
    if yardstick <= 0 or own[slowest] < factor * yardstick:
        return None
    shares = [o / s if s > 0 else 0.0 for o, s in zip(own, steps, strict=True)]
    return Straggler(
        rank=slowest,
        node=nodes[slowest],
        share=shares[slowest],
        median_share=statistics.median(shares),
        ratio=own[slowest] / yardstick,
        first_step=first_step,
        last_step=first_step + len(own_s[0]) - 1,
    )


SCHEDSTAT = "/proc/thread-self/schedstat"


def thread_demand_s() -> float:
    """Seconds the calling thread has run plus waited for a CPU while ready to run
    (schedstat's first two fields); its CPU time where schedstat cannot be read."""
    try:
        with open(SCHEDSTAT, "rb") as f:
            ran_ns, waited_ns, _slices = f.read().split()
    except (OSError, ValueError):
        return time.thread_time()
    return (int(ran_ns) + int(waited_ns)) / 1e9


class StragglerWatch:
    """Times this rank's own work per step; every ``every`` steps names a straggler, if any.

    Call ``begin()`` before a step's forward and ``end(step)`` after its optimizer step, on
    the thread that trains; ``end`` returns the line to print (on every rank; print it on
    one) or None."""

    def __init__(
        self,
        *,
        every: int,
        factor: float = DEFAULT_FACTOR,
        group: dist.ProcessGroup | None = None,
    ):
        if every < 1:
            raise ValueError(f"every must be >= 1 step, got {every!r}")
        self.every, self.factor, self.group = every, factor, group
        self.node = int(os.environ.get("GROUP_RANK", "0"))
        self._own: list[float] = []
        self._step: list[float] = []
        self._start = self._demand = 0.0

    def begin(self) -> None:
        """A step starts (before its forward)."""
        self._start, self._demand = time.perf_counter(), thread_demand_s()

    def end(self, step: int) -> str | None:
        """The step ended (after its optimizer step): the line naming a straggler, every
        ``every`` steps, when there is one (the same on every rank)."""
        self._own.append(thread_demand_s() - self._demand)
        self._step.append(time.perf_counter() - self._start)
        if len(self._own) < self.every:
            return None
        mine = torch.tensor([*self._own, *self._step, float(self.node)], dtype=torch.float64)
        self._own, self._step = [], []
        world = dist.get_world_size(self.group)
        gathered = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(gathered, mine, group=self.group)
        k = self.every
        found = name_straggler(
            [t[:k].tolist() for t in gathered],
            [t[k : 2 * k].tolist() for t in gathered],
            [int(t[-1]) for t in gathered],
            first_step=step - k + 1,
            factor=self.factor,
        )
        return None if found is None else found.line()
