"""The chaos benchmark's fault schedule: seeded, so a failing run can be replayed exactly.

Each fault strikes when rank 0 first prints a given step's line (after the previous fault
finished), or, for a kill during a load, when it prints ``resuming:`` after the restart the
previous fault caused. The schedule is a pure function of its arguments (no lab, no torch):
the default test run checks it in milliseconds.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass

__all__ = ["KINDS", "PRIORITY", "RESTARTING", "ChaosFault", "schedule"]

# what a fault does (benchmarks/chaos_strike.py strikes each from outside the job)
KINDS = (
    "node-loss",  # SIGKILL to every process of a node's namespace (a power loss)
    "rank-kill",  # SIGKILL to one worker (found by its RANK)
    "agent-kill",  # SIGKILL to a node's torchrun agent alone
    "link-down",  # a node's link down for LINK_DOWN_S
    "storage-stall",  # a node's sshfs stopped (SIGSTOP) for STORAGE_STALL_S
    "save-kill",  # a node lost right after a checkpointed step's line: during its save
    "load-kill",  # a node lost when the restarted workers start loading
    "node-pause",  # every process of a node stopped (SIGSTOP) for two leases
)
# the faults after which the workers restart (a load follows, which a load-kill can strike)
RESTARTING = frozenset({"node-loss", "rank-kill", "agent-kill", "save-kill", "load-kill"})
# which kinds a schedule shorter than KINDS keeps (--quick): the ones that test the most
PRIORITY = (
    "node-loss",
    "load-kill",
    "save-kill",
    "node-pause",
    "storage-stall",
    "agent-kill",
    "rank-kill",
    "link-down",
)
LOAD_TRIGGER = "resuming:"


@dataclass(frozen=True)
class ChaosFault:
    """One fault: what, where (a node; a global rank for rank-kill) and at which step."""

    kind: str
    target: int
    step: int | None  # None: load-kill, struck at the next "resuming:" line

    @property
    def trigger(self) -> str:
        """The text of rank 0's line that sets it off (train.py's step line format)."""
        return LOAD_TRIGGER if self.step is None else f"step {self.step:5d} |"

    def describe(self) -> str:
        where = f"rank {self.target}" if self.kind == "rank-kill" else f"node {self.target}"
        when = "at the next load" if self.step is None else f"at step {self.step}"
        return f"{self.kind} {where} {when}"


def _kinds(rng: random.Random, count: int) -> list[str]:
    """``count`` kinds, every kind once when there is room, a load-kill only after a fault
    that restarts the workers (never two in a row, never first)."""
    if count < len(KINDS):
        kinds = list(PRIORITY[:count])
        if "load-kill" in kinds and not (set(kinds) & (RESTARTING - {"load-kill"})):
            raise ValueError(f"count {count}: a load-kill needs a restarting fault before it")
    else:
        extra = [k for k in KINDS if k != "load-kill"]
        kinds = list(KINDS) + rng.choices(extra, k=count - len(KINDS))
    loads = kinds.count("load-kill")
    rest = [k for k in kinds if k != "load-kill"]
    rng.shuffle(rest)
    restarting = [i for i, k in enumerate(rest) if k in RESTARTING]
    if len(restarting) < loads:
        raise ValueError(f"count {count}: too few restarting faults for {loads} load-kill(s)")
    after = set(rng.sample(restarting, loads))
    out = []
    for i, kind in enumerate(rest):
        out.append(kind)
        if i in after:
            out.append("load-kill")
    return out


def schedule(
    seed: int,
    steps: int,
    count: int,
    *,
    nodes: int = 3,
    ranks_per_node: int = 2,
    ckpt_every: int = 10,
) -> list[ChaosFault]:
    """``count`` faults over a run of ``steps`` steps, the same for the same arguments.

    Every kind is there once ``count`` >= len(KINDS) (else the first ``count`` of PRIORITY);
    one node loss strikes node 0 (the rendezvous must not live there); a save-kill strikes
    at a checkpointed step; the faults that wait for a step are spread evenly, with jitter,
    leaving the first and the last steps of the run alone."""
    if count < 1:
        raise ValueError(f"count must be >= 1 fault, got {count}")
    rng = random.Random(seed)
    kinds = _kinds(rng, count)
    stepped = [k for k in kinds if k != "load-kill"]
    lead = tail = max(2, ckpt_every)
    gap = (steps - lead - tail) // len(stepped)
    if gap < ckpt_every + 2:
        raise ValueError(
            f"steps {steps}: too few for {len(stepped)} faults {ckpt_every} steps apart; "
            f"pass at least {lead + tail + len(stepped) * (ckpt_every + 2)} steps or fewer faults"
        )
    at = []
    for i, kind in enumerate(stepped):
        step = lead + i * gap + rng.randint(0, gap // 3)
        if kind == "save-kill":  # the next checkpointed step, still before the next fault
            step = -(-step // ckpt_every) * ckpt_every
        at.append(step)
    assert all(a < b for a, b in itertools.pairwise(at)) and at[-1] < steps, at
    steps_of = iter(at)
    faults = []
    for kind in kinds:
        step = None if kind == "load-kill" else next(steps_of)
        world = nodes * ranks_per_node
        target = rng.randrange(world if kind == "rank-kill" else nodes)
        faults.append(ChaosFault(kind, target, step))
    losses = [i for i, f in enumerate(faults) if f.kind == "node-loss"]
    if losses and all(faults[i].target != 0 for i in losses):
        first = faults[losses[0]]
        faults[losses[0]] = ChaosFault(first.kind, 0, first.step)
    return faults
