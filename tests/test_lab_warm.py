"""Warm workers in the lab: every node's workers are forked from its warm server, a rank
killed from outside (found by its RANK in /proc, as for a fresh worker) is a killed rank
for torchrun, the restart forks again, a fresh node in a lost one's place is forked from
the spare into its own namespaces, and the lab leaves nothing behind."""

from __future__ import annotations

import json

import pytest

from fsdp_ext.lab import Cluster, Fault
from fsdp_ext.lab.cleanup import namespace_inode, namespace_pids
from tests.lab_helpers import PROGRAMS, leftovers, require_lab

pytestmark = pytest.mark.slow  # warm servers importing torch at once: 30-40 s each


def test_workers_are_forked_warm_and_a_killed_one_is_a_killed_rank():
    require_lab()
    with Cluster(2, 2, "1gbit", warm_workers=True) as lab:
        assert "warm workers" in lab.describe()
        servers = [pid for ns in lab.namespaces for pid in namespace_pids(ns)]
        shared = lab.shared_dir
        kill = Fault("kill-rank", 3, on_output="ready")
        program = [str(PROGRAMS / "warm_check.py"), str(shared)]
        result = lab.run(program, max_restarts=3, faults=[kill], timeout=240)
        assert result.returncode == 0, result.problems
        assert result.problems == []  # nothing of the job outlived its torchruns
        records = {p.name: json.loads(p.read_text()) for p in shared.glob("rank*.json")}
        phases = {name.rsplit(".", 2)[0] for name in records}
        assert phases == {f"rank{r}.{p}" for r in range(4) for p in ("before", "after")}
        for name, record in records.items():
            assert record["torch"], f"{name}: not forked from a warm server"
            assert any(part.endswith("fsdp_ext/warm/server.py") for part in record["parent"])
        # the strike found rank 3's worker (and its client) by RANK in /proc/PID/environ
        (event,) = result.faults
        (killed,) = [r["pid"] for n, r in records.items() if n.startswith("rank3.before.")]
        assert str(killed) in event.note
        assert "node 1" in event.note
        run_id, pids = lab.run_id, servers
    assert leftovers(run_id, pids=pids) == []


def _records(shared) -> dict[str, dict]:
    return {p.name: json.loads(p.read_text()) for p in shared.glob("rank*.json")}


def test_a_fresh_node_is_forked_from_the_spare_into_its_own_namespaces():
    require_lab()
    with Cluster(2, 2, "1gbit", warm_workers=True, warm_spare=True) as lab:
        assert "a warm spare" in lab.describe()
        shared = lab.shared_dir
        kill = Fault("kill-node", 1, on_output="ready")
        program = [str(PROGRAMS / "warm_check.py"), str(shared)]
        result = lab.run(program, max_restarts=3, faults=[kill], replace_failed=True, timeout=240)
        assert result.returncode == 0, result.problems
        (loss,) = result.losses
        assert "a fresh node 1 took its place" in loss.note
        node1 = namespace_inode(lab.topology.node_namespaces[1])
        records = _records(shared)
        fresh = [r for name, r in records.items() if ".after." in name and r["netns"] == node1]
        assert len(fresh) == 2  # the fresh node's two ranks, in node 1's network namespace
        for record in fresh:  # forked by the spare (its socket), not started
            assert record["torch"] and any(p.endswith("spare.sock") for p in record["parent"])
        run_id = lab.run_id
    assert leftovers(run_id) == []
