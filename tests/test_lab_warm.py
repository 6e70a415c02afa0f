"""Warm workers in the lab: every node's workers are forked from its warm server, a rank
killed from outside (found by its RANK in /proc, as for a fresh worker) is a killed rank
for torchrun, the restart forks again, and the lab leaves nothing behind."""

from __future__ import annotations

import json

import pytest

from fsdp_ext.lab import Cluster, Fault
from fsdp_ext.lab.cleanup import namespace_pids
from tests.lab_helpers import PROGRAMS, leftovers, require_lab

pytestmark = pytest.mark.slow  # two warm servers importing torch at once: about 30 s


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
