"""The lab's supervision of a job, without a lab: real processes stand in for the nodes'
torchruns, killed from outside as a power loss would. Each test names the mutant it kills."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from fsdp_ext.lab.launcher import LOST, Job
from fsdp_ext.lab.supervisor import LossPolicy, lost_cause


def _node(seconds: float, status: int = 0) -> subprocess.Popen:
    """A stand-in torchrun: runs ``seconds``, then exits with ``status``."""
    code = f"import sys, time; time.sleep({seconds}); sys.exit({status})"
    return subprocess.Popen([sys.executable, "-c", code], start_new_session=True)


def _job(procs: list[subprocess.Popen], tmp_path) -> Job:
    return Job(procs, [tmp_path / f"node{i}.log" for i in range(len(procs))], elastic=True)


def test_a_node_killed_from_outside_is_lost_and_the_others_finish(tmp_path):
    """Node 1's torchrun dies by SIGKILL while node 0 trains on: the job is told once
    (``on_lost``) and ends with node 0's status (mutant: the supervisor ends the job on an
    unannounced node death, exit status -9)."""
    job = _job([_node(1.5), _node(60)], tmp_path)
    seen = []
    job.on_lost = lambda node, cause: seen.append((node, cause))
    os.kill(job.procs[1].pid, signal.SIGKILL)
    try:
        assert job.wait(time.monotonic() + 30) == (0, False)
    finally:
        job.stop()
    assert seen == [(1, "its torchrun was killed by SIGKILL")]
    assert job.failure is None and job.doomed is None


def test_a_replacement_nodes_failure_fails_the_job(tmp_path):
    """Node 1 is lost and a fresh node takes its place; the fresh node then fails on its own
    (status 3) while node 0 finishes: the job failed, and says which node (mutant: the
    replacement left marked as lost, so its failure is ignored and the job reports 0)."""
    job = _job([_node(2.0), _node(60)], tmp_path)
    job.on_lost = lambda node, cause: job.replace(node, _node(0.2, status=3))
    os.kill(job.procs[1].pid, signal.SIGKILL)
    try:
        code, timed_out = job.wait(time.monotonic() + 30)
    finally:
        job.stop()
    assert (code, timed_out) == (3, False)
    assert job.failure == "node 1's torchrun failed with exit status 3"


def test_a_lost_replacement_is_lost_again(tmp_path):
    """A fresh node that is itself killed is a second loss, handed over again."""
    job = _job([_node(2.0), _node(60)], tmp_path)
    seen = []

    def on_lost(node: int, cause: str) -> None:
        seen.append(node)
        if len(seen) == 1:
            fresh = _node(60)
            job.replace(node, fresh)
            os.kill(fresh.pid, signal.SIGKILL)

    job.on_lost = on_lost
    os.kill(job.procs[1].pid, signal.SIGKILL)
    try:
        assert job.wait(time.monotonic() + 30) == (0, False)
    finally:
        job.stop()
    assert seen == [1, 1]


def test_without_a_scheduler_a_lost_node_ends_the_job(tmp_path):
    job = _job([_node(60), _node(60)], tmp_path)
    os.kill(job.procs[1].pid, signal.SIGKILL)
    try:
        assert job.wait(time.monotonic() + 30) == (LOST, False)
    finally:
        job.stop()
    assert job.doomed == "node 1 was lost (its torchrun was killed by SIGKILL)"


@pytest.mark.parametrize(
    ("returncode", "namespace_up", "cause"),
    [
        (None, True, None),
        (0, True, None),
        (1, True, None),  # failed on its own: the job's failure, not a loss
        (-9, True, "its torchrun was killed by SIGKILL"),
        (-15, True, "its torchrun was killed by SIGTERM"),
        (None, False, "its namespace was torn down"),
    ],
)
def test_lost_or_failed(returncode, namespace_up, cause):
    assert lost_cause(returncode, namespace_up) == cause


def _policy(**kw) -> LossPolicy:
    base = dict(nodes=2, max_restarts=3, min_nodes=1, replace_failed=False, rdzv="c10d")
    return LossPolicy(**{**base, **kw})


@pytest.mark.parametrize(
    ("policy", "node", "lost", "words"),
    [
        (_policy(), 1, {1}, None),
        (_policy(min_nodes=None, replace_failed=True), 1, {1}, None),
        (_policy(rdzv="etcd"), 0, {0}, None),
        (_policy(rdzv="etcd", min_nodes=None, replace_failed=True), 0, {0}, None),
        (_policy(), 0, {0}, "hosts the c10d rendezvous store"),
        (_policy(replace_failed=True), 0, {0}, "run the rendezvous off the training nodes"),
        (_policy(max_restarts=0, min_nodes=None), 1, {1}, "the job is not elastic"),
        (_policy(nodes=3, min_nodes=2), 2, {1, 2}, "1 node(s) remain, fewer than the job's"),
        (_policy(min_nodes=None), 1, {1}, "pass --min-nodes 1 (elastic) or --replace-failed"),
    ],
)
def test_the_job_fails_only_when_it_cannot_go_on(policy, node, lost, words):
    why = policy.verdict(node, "its torchrun was killed by SIGKILL", lost)
    if words is None:
        assert why is None
    else:
        assert words in why and "\n" not in why, why
