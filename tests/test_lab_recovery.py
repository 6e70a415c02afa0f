"""A lab job loses a node and carries on by itself (examples/train.py on 2 nodes: 1 rank each
by default, 2 each in the slow run).

Every process of node 1 (its torchrun, its ranks, its sshfs) gets SIGKILL from outside, in
the middle of the run, unannounced: the test lists them with ``ip netns pids`` and kills
each, and the lab is told nothing (no lab fault). The lab's supervisor finds node 1 lost.
With ``min_nodes=1`` torchrun's survivors on node 0 meet in a new rendezvous and the workers
resume from the newest intact checkpoint on the shared directory, on node 0's ranks alone.
With ``replace_failed`` a fresh node 1 joins and the job finishes on both nodes. The default
run has the replaced job alone; the slow run has both on one lab (node 1's dead sshfs is
remounted before the second). Nothing of the lab is left afterwards. Without a replacement,
the default run holds the survivors' path in test_lab_supervisor.py (a node killed from
outside is lost and the others finish) and test_recovery.py (a resume on fewer ranks).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from fsdp_ext.lab import Cluster, Fault
from tests.lab_helpers import KillOnLine, leftovers, recovery_figures, require_lab
from tests.train_flags import TINY

REPO = Path(__file__).resolve().parent.parent
TRAIN = str(REPO / "examples" / "train.py")


def _train(out: Path, steps: int, ckpt_every: int) -> list[str]:
    """Synchronous saves: the bound checked here is theirs, a resume at most one interval of
    steps before the kill. A background save's is one more interval (the steps that ran
    during the write the kill struck; on sshfs a write of this tiny model outlasts 3 steps)."""
    flags = ["--steps", str(steps), "--ckpt-every", str(ckpt_every), "--no-async-save"]
    return [TRAIN, *TINY, *flags, "--out", str(out)]


def _kill_node_1_at(step: int) -> Fault:
    return Fault("kill-node", 1, on_output=f"step {step:5d} |")


def _step_line(step: int) -> str:
    return f"step {step:5d} |"


def _summary(result) -> dict:
    report = result.last_json()
    assert report is not None, result.output[-3000:]
    resumed = re.findall(r"resumed from \S+step-(\d+) at step", result.output)
    return {**report, "resumed": [int(s) for s in resumed]}


def _check_recovered(result, *, steps: int, kill_at: int, ckpt_every: int, world: int) -> None:
    assert result.returncode == 0 and not result.timed_out, result.output[-4000:] + "\n".join(
        result.problems
    )
    summary = _summary(result)
    assert summary["steps"] == steps and summary["world_size"] == world
    # one restart, from a checkpoint at most one interval before the kill
    [resumed] = summary["resumed"]
    assert resumed % ckpt_every == 0 and 0 <= kill_at - resumed <= ckpt_every, summary
    # the lab struck nothing: its supervisor found node 1 lost by itself
    assert result.faults == []
    [loss] = result.losses
    assert loss.node == 1 and loss.cause == "its torchrun was killed by SIGKILL", loss


def _run_jobs(
    names: tuple[str, ...],
    steps: int,
    kill_at: int,
    ckpt_every: int,
    timeout: float,
    ranks_per_node: int = 1,
):
    """Each named job in turn on one lab of 2 nodes ("fewer": ``min_nodes=1`` alone;
    "replaced": with ``replace_failed``), node 1 killed at ``kill_at`` in each."""
    require_lab()
    with Cluster(2, ranks_per_node, "1gbit") as lab:
        run_id = lab.run_id
        jobs = {}
        for name in names:
            killer = KillOnLine(lab.topology.node_namespaces[1], _step_line(kill_at))
            result = lab.run(
                _train(lab.shared_dir / name, steps, ckpt_every),
                max_restarts=3,
                min_nodes=1,
                replace_failed=name == "replaced",
                echo=killer,
                timeout=timeout,
            )
            assert killer.killed, f"{name}: nothing was killed: {result.output[-2000:]}"
            jobs[name] = result
            print(name, recovery_figures(result, killer), result.losses)
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return jobs, run_id, netns


SHORT = {"steps": 12, "kill_at": 6, "ckpt_every": 3}


@pytest.fixture(scope="module")
def replaced_job():
    """One rank per node, the replaced job alone (a worker is about 5 CPU-s of imports); the
    job on the survivors alone, and the 2 x 2 job, are in the slow run below."""
    return _run_jobs(("replaced",), **SHORT, timeout=300)


def test_node_lost_job_finishes_on_a_replacement_node(replaced_job):
    jobs, _, _ = replaced_job
    _check_recovered(jobs["replaced"], **SHORT, world=2)


@pytest.mark.slow
def test_node_lost_job_finishes_on_the_survivors_then_on_a_replacement_node():
    jobs, run_id, netns = _run_jobs(("fewer", "replaced"), **SHORT, timeout=300)
    _check_recovered(jobs["fewer"], **SHORT, world=1)
    _check_recovered(jobs["replaced"], **SHORT, world=2)
    # the second job found node 1's shared directory again (its sshfs had died with it)
    assert any("remounted" in p for p in jobs["replaced"].problems), jobs["replaced"].problems
    assert run_id not in netns and leftovers(run_id) == []


def test_nothing_of_the_lab_is_left(replaced_job):
    _, run_id, netns = replaced_job
    assert run_id not in netns
    assert leftovers(run_id) == []


@pytest.mark.slow
def test_node_lost_at_step_30_of_60():
    """The issue's acceptance run: node 1 lost at step 30 of 60, checkpoints every 10."""
    jobs, run_id, netns = _run_jobs(
        ("fewer", "replaced"), steps=60, kill_at=30, ckpt_every=10, timeout=600, ranks_per_node=2
    )
    fewer, replaced = jobs["fewer"], jobs["replaced"]
    _check_recovered(fewer, steps=60, kill_at=30, ckpt_every=10, world=2)
    _check_recovered(replaced, steps=60, kill_at=30, ckpt_every=10, world=4)
    assert run_id not in netns and leftovers(run_id) == []


@pytest.mark.slow
def test_a_replaced_node_resumes_from_its_peers_copy_in_ram():
    """A fixed-size job (2 nodes) with --snapshot-every 1 loses node 1 at step 6; a fresh
    node 1 (empty RAM) joins, and its ranks 2 and 3 get step 6 from the copies node 0 holds
    in its RAM, sent over the process group: at most K = 1 step is lost (the kill may land
    before step 6's snapshot), where the disk checkpoint of step 3 would lose 3."""
    require_lab()
    with Cluster(2, 2, "1gbit") as lab:
        run_id = lab.run_id
        out = lab.shared_dir / "snap"
        result = lab.run(
            [*_train(out, 12, 3), "--snapshot-every", "1"],
            max_restarts=3,
            faults=[_kill_node_1_at(6)],
            replace_failed=True,
            timeout=300,
        )
    assert result.returncode == 0, result.output[-4000:] + "\n".join(result.problems)
    summary = _summary(result)
    assert summary["steps"] == 12 and summary["world_size"] == 4
    [line] = [ln for ln in result.output.splitlines() if ln.startswith("resumed from")]
    assert "in-memory snapshot, ranks [2, 3] from their peer's copy" in line, line
    assert summary["resumed"][0] >= 6 - 1  # newer than the disk's step 3
    assert leftovers(run_id) == []
