"""The other ways a node dies on its own: its agent killed alone, its namespace torn down.

One lab of 2 nodes x 1 rank with storage; each job all-reduces in a loop
(lab_programs/elastic_check.py), and node 1 is struck from outside when rank 0 prints
step 4; the lab is told nothing. Each time the lab finds node 1 lost, drains what is left of
it (even in a namespace that lost its name), and the job goes on or gets a fresh node 1.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from pathlib import Path

import pytest

from fsdp_ext.lab import Cluster
from tests.lab_helpers import PROGRAMS, KillOnLine, leftovers, require_lab

pytestmark = pytest.mark.slow  # three lab jobs: about 2 minutes on the loaded 2-core machine
PROGRAM = [str(PROGRAMS / "elastic_check.py"), "15", "0.2"]


def _pids(namespace: str) -> list[int]:
    out = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def _kill_agent(namespace: str) -> list[int]:
    """SIGKILL node's torchrun agent only: its workers go on, orphaned."""
    agents = []
    for pid in _pids(namespace):
        with contextlib.suppress(OSError):
            if b"torch.distributed.run" in Path(f"/proc/{pid}/cmdline").read_bytes():
                agents.append(pid)
    for pid in agents:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return agents


def _tear_down(namespace: str) -> list[int]:
    """``ip netns del``: the name is gone; its processes run on, unnamed."""
    left = _pids(namespace)
    subprocess.run(["ip", "netns", "del", namespace], check=True)
    return left


@pytest.fixture(scope="module")
def jobs():
    require_lab()
    with Cluster(2, 1, "1gbit") as lab:
        ns = lab.topology.node_namespaces[1]
        found = {"run_id": lab.run_id}
        for name, action, replace in (
            ("agent", _kill_agent, False),
            ("torn down", _tear_down, False),
            ("torn down, replaced", _tear_down, True),
        ):
            killer = KillOnLine(ns, "step 4 ", action=lambda a=action: a(ns))
            result = lab.run(
                PROGRAM,
                echo=killer,
                max_restarts=2,
                min_nodes=1,
                replace_failed=replace,
                timeout=150,
            )
            found[name] = (result, killer.killed)
    return found


@pytest.mark.parametrize(
    ("name", "cause", "world"),
    [
        ("agent", "its torchrun was killed by SIGKILL", 1),
        ("torn down", "its namespace was torn down", 1),
        ("torn down, replaced", "its namespace was torn down", 2),
    ],
)
def test_a_node_lost_another_way_is_lost_not_failed(jobs, name, cause, world):
    result, struck = jobs[name]
    assert struck, name
    assert result.returncode == 0, result.output[-3000:] + "\n".join(result.problems)
    [loss] = result.losses
    assert (loss.node, loss.cause) == (1, cause)
    report = result.last_json()
    assert report["world"] == world and report["sum"] == world * (world + 1) / 2, report
    if name == "agent":  # its orphaned worker was drained with the rest of the node
        assert "processes left of it killed" in loss.note, loss.note


def test_a_torn_down_node_is_whole_for_the_next_job(jobs):
    """Node 1, torn down in the second job and not replaced, was built again at once (empty):
    the third job started on it (its processes were there to strike), with nothing to
    rebuild first."""
    result, struck = jobs["torn down, replaced"]
    assert struck and not any("built it again" in p for p in result.problems), result.problems


def test_nothing_is_left(jobs):
    assert leftovers(jobs["run_id"]) == []
