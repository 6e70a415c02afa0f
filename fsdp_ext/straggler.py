"""Naming a straggler: the rank whose own work per step takes far longer than the others'.

In synchronous data parallelism every rank's step lasts as long as the slowest rank's, so
step times alone cannot say who is slow: the fast ranks spend the difference waiting in
the collectives. What differs is each rank's *own* time. ``StragglerWatch`` measures it in
the forward pass, per FSDP unit: a forward pre-hook in front of FSDP's (which waits for the
unit's all-gather) and one behind it give the wait; a forward hook in front of FSDP's
post-forward ends the unit. The rank's own time is its forward wall time (first unit in to
last unit out) minus those waits. Every ``every`` steps one small all-gather (two floats per step
and the node index, per rank) brings every rank's times to all, and ``name_straggler``
judges them on each rank's own median, against the median rank: a single slow step (a
garbage collection, a page fault) is no straggler, and a slow node of two ranks does not
drag the yardstick up with it, as a mean would.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

__all__ = ["Straggler", "StragglerWatch", "name_straggler"]

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


class StragglerWatch:
    """Times this rank's own work per step; every ``every`` steps names a straggler, if any.

    Call ``begin()`` before a step's forward and ``end(step)`` after its optimizer step;
    ``end`` returns the line to print (on every rank; print it on one) or None. ``modules``:
    the model parts; the FSDP units among them (``fully_shard``) are timed."""

    def __init__(
        self,
        modules: Iterable[nn.Module],
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
        self._wait = 0.0
        self._entered = self._start = 0.0
        self._first: float | None = None
        self._last: float | None = None
        self._handles = []
        units = [m for part in modules for m in part.modules() if isinstance(m, FSDPModule)]
        if not units:
            raise ValueError("modules: no FSDP unit to time (apply fully_shard first)")
        for unit in units:
            self._handles.append(unit.register_forward_pre_hook(self._before, prepend=True))
            self._handles.append(unit.register_forward_pre_hook(self._after))
            self._handles.append(unit.register_forward_hook(self._done, prepend=True))

    def _before(self, *_args) -> None:
        self._entered = time.perf_counter()
        if self._first is None:
            self._first = self._entered

    def _after(self, *_args) -> None:
        self._wait += time.perf_counter() - self._entered

    def _done(self, *_args) -> None:
        self._last = time.perf_counter()

    def begin(self) -> None:
        """A step starts (before its forward)."""
        self._wait, self._first, self._last = 0.0, None, None
        self._start = time.perf_counter()

    def end(self, step: int) -> str | None:
        """The step ended (after its optimizer step): the line naming a straggler, every
        ``every`` steps, when there is one (the same on every rank)."""
        now = time.perf_counter()
        forward = 0.0 if self._first is None else (self._last or now) - self._first
        self._own.append(max(0.0, forward - self._wait))
        self._step.append(now - self._start)
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

    def remove(self) -> None:
        """Take the hooks off the model."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
