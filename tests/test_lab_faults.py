"""Faults struck from outside a lab job end in recovery or in a prompt, named error.

One lab of 2 nodes x 1 rank; each job all-reduces in a loop (lab_programs/elastic_check.py)
and each fault strikes when rank 0 prints step 4. Never a hang: every job ends well inside
its timeout.
"""

from __future__ import annotations

import pytest

from fsdp_ext.lab import Cluster, Fault
from fsdp_ext.lab.launcher import LOST
from tests.lab_helpers import PROGRAMS, require_lab

pytestmark = pytest.mark.slow  # five lab jobs: about 40 s on a quiet machine
STEPS, STEP_S, TIMEOUT_S = 15, 0.1, 150
AT = "step 4 "


def _job(lab, fault_kind, target, *, shared=False, duration=None, **options):
    program = [str(PROGRAMS / "elastic_check.py"), str(STEPS), str(STEP_S)]
    if shared:
        program.append(str(lab.shared_dir))
    fault = Fault(fault_kind, target, on_output=AT, duration_s=duration)
    return lab.run(program, faults=[fault], timeout=TIMEOUT_S, **options)


@pytest.fixture(scope="module")
def jobs():
    require_lab()
    with Cluster(2, 1, "1gbit") as lab:
        yield {
            "kill-rank": _job(lab, "kill-rank", 1, max_restarts=1),
            "link-down": _job(lab, "link-down", 1, duration=2.0),
            "storage-down": _job(lab, "storage-down", 1, shared=True, max_restarts=1),
            "kill-node, not elastic": _job(lab, "kill-node", 1),
            "kill-node 0": _job(lab, "kill-node", 0, max_restarts=2, min_nodes=1),
        }


def _final(result) -> dict:
    report = result.last_json()
    assert report is not None, result.output[-3000:]
    return report


def test_faults_end_well_inside_the_timeout(jobs):
    for name, result in jobs.items():
        assert not result.timed_out and result.seconds < TIMEOUT_S / 2, name
        assert len(result.faults) == 1, (name, result.problems)


def test_a_killed_rank_is_restarted_and_the_job_finishes(jobs):
    result = jobs["kill-rank"]
    assert result.returncode == 0, result.output[-3000:]
    assert "SIGKILL to rank 1's processes" in result.faults[0].note
    report = _final(result)
    assert report["world"] == 2 and report["sum"] == 3.0  # both ranks in the last step


def test_a_link_down_for_two_seconds_stalls_and_goes_on(jobs):
    """TCP retransmits what the dead link lost: no restart, every step done."""
    result = jobs["link-down"]
    assert result.returncode == 0, result.output[-3000:]
    report = _final(result)
    assert report["attempt"] == 0 and report["sum"] == 3.0
    assert report["seconds"] >= STEPS * STEP_S + 2.0  # the steps, and the outage


def test_storage_loss_is_a_named_error(jobs):
    result = jobs["storage-down"]
    assert result.returncode != 0
    assert "node 1's sshfs killed" in result.faults[0].note
    assert "Transport endpoint is not connected" in result.rank_stderr[1]


def test_a_lost_node_ends_a_fixed_size_job_at_once(jobs):
    result = jobs["kill-node, not elastic"]
    assert result.returncode == LOST
    assert "node 1 was lost and the job is not elastic" in result.problems[-1]
    assert "--min-nodes 1 or --replace-failed" in result.problems[-1]
    assert result.seconds < 60


def test_losing_the_rendezvous_host_is_named(jobs):
    result = jobs["kill-node 0"]
    assert result.returncode == LOST
    assert any("it hosts the c10d rendezvous store" in p for p in result.problems)
