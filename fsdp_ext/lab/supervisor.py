"""Telling a lost node from a failed job, as an elastic scheduler does.

A node whose torchrun dies by a signal (a power loss, the OOM killer, its agent killed) or
whose namespace disappears is *lost*: nobody asked it to stop, and the job may go on without
it. A torchrun that exits with a status of its own (its workers failed after every restart,
its rendezvous gave up) has *failed*, and that fails the job. Only the policy below decides
whether a lost node ends the job, so that it never ends for a reason it could have survived.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from pathlib import Path

__all__ = ["NETNS_DIR", "LossPolicy", "NodeLoss", "lost_cause", "namespace_exists"]

NETNS_DIR = Path("/run/netns")  # where `ip netns add` pins a named namespace


def namespace_exists(namespace: str) -> bool:
    """Whether ``ip netns`` still knows ``namespace`` (a stat, cheap enough to poll)."""
    return (NETNS_DIR / namespace).exists()


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def lost_cause(returncode: int | None, namespace_up: bool) -> str | None:
    """Why a node counts as lost, or None: it still runs, or it exited on its own (its exit
    status, 0 or not, is the job's business, not a loss)."""
    if not namespace_up:
        return "its namespace was torn down"
    if returncode is not None and returncode < 0:
        return f"its torchrun was killed by {_signal_name(-returncode)}"
    return None


@dataclass(frozen=True)
class NodeLoss:
    """A node the lab found lost while a job ran, and what it did about it."""

    node: int
    cause: str  # lost_cause's words
    at_s: float  # when the lab saw it, seconds after the job started
    note: str  # what followed: the job went on, a fresh node came, or why the job ended
    replaced_at_s: float | None = None  # when a fresh node's torchrun was started


@dataclass(frozen=True)
class LossPolicy:
    """What the job was started with: how many nodes, and how it may survive losing one."""

    nodes: int
    max_restarts: int
    min_nodes: int | None
    replace_failed: bool
    rdzv: str

    def verdict(self, node: int, cause: str, lost: set[int]) -> str | None:
        """None when the job goes on after losing ``node`` (``lost`` holds it and every other
        node down now); else the one line that says why it cannot, and which flag helps."""
        left = self.nodes - len(lost)
        fewest = self.nodes if self.min_nodes is None else self.min_nodes
        if node == 0 and self.rdzv != "etcd" and self.nodes > 1:
            return (
                f"node 0 was lost ({cause}): it hosts the {self.rdzv} rendezvous store, which the "
                "other nodes cannot go on without (no torchrun job survives its rendezvous "
                "host); run the rendezvous off the training nodes with --rdzv etcd"
            )
        if self.max_restarts == 0:
            return (
                f"node {node} was lost and the job is not elastic (max_restarts 0; {cause}): "
                f"pass --max-restarts 1 or more with --min-nodes {max(1, left)} or "
                "--replace-failed"
            )
        if self.replace_failed or left >= fewest:
            return None
        return (
            f"node {node} was lost ({cause}) and {left} node(s) remain, fewer than the job's "
            f"minimum of {fewest}; pass --min-nodes {max(1, left)} (elastic) or --replace-failed"
        )
