"""``--rdzv etcd``: the rendezvous lives in etcd on the lab's infrastructure namespace, which
runs no training, so any node may be lost, node 0 included.

The default run builds one 2-node lab and checks where the rendezvous is, from the kernel's
side (which namespace holds the address each node's endpoint resolves to, which one runs
etcd), then runs a short job through it. The slow run kills node 0 from outside during a
training job and watches it finish without it, and with a fresh node 0.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from fsdp_ext.lab import Cluster
from fsdp_ext.lab.launcher import torchrun_argv
from fsdp_ext.lab.rendezvous import etcd_missing
from tests.lab_helpers import PROGRAMS, KillOnLine, leftovers, recovery_figures, require_lab
from tests.train_flags import TINY

REPO = Path(__file__).resolve().parent.parent
TRAIN = str(REPO / "examples" / "train.py")


def _require_etcd() -> None:
    require_lab()
    if etcd_missing():
        pytest.skip(f"--rdzv etcd needs {', '.join(etcd_missing())} (scripts/lab-packages.sh)")


def _addresses(namespace: str) -> set[str]:
    out = subprocess.run(
        ["ip", "-n", namespace, "-o", "-4", "addr", "show"], capture_output=True, text=True
    ).stdout
    return set(re.findall(r"inet (\d+\.\d+\.\d+\.\d+)/", out))


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _pids(namespace: str) -> list[int]:
    out = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


@pytest.fixture(scope="module")
def etcd_lab():
    _require_etcd()
    with Cluster(2, 1, "1gbit", storage=False, rdzv="etcd") as lab:
        topology = lab.topology
        found = {"run_id": lab.run_id}
        found["endpoints"] = []
        for node in range(2):
            argv = torchrun_argv(
                topology, node, 1, ["x.py"], rdzv="etcd", python="python", log_dir=Path("/l")
            )
            assert argv[argv.index("--rdzv-backend") + 1] == "etcd-v2"
            host, port = argv[argv.index("--rdzv-endpoint") + 1].rsplit(":", 1)
            resolved = lab.exec(node, ["getent", "ahostsv4", host]).stdout.split()[0]
            found["endpoints"].append((host, port, resolved))
        found["infra"] = _addresses(topology.infra_namespace)
        found["nodes"] = [_addresses(ns) for ns in topology.node_namespaces]
        found["etcd_in"] = [
            ns for ns in topology.namespaces if any(_comm(p) == "etcd" for p in _pids(ns))
        ]
        found["infra_ns"] = topology.infra_namespace
        found["job"] = lab.run(
            [str(PROGRAMS / "elastic_check.py"), "3", "0.05"],
            max_restarts=1,
            min_nodes=1,
            timeout=120,
        )
    found["netns"] = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return found


def test_the_rendezvous_is_off_the_training_nodes(etcd_lab):
    """Each node's endpoint resolves, inside that node, to an address of the infrastructure
    namespace, held by no training node (mutant: the endpoint pinned to node 0's address)."""
    for node, (_, port, resolved) in enumerate(etcd_lab["endpoints"]):
        assert port == "2379"
        assert resolved in etcd_lab["infra"], (node, resolved, etcd_lab["infra"])
        assert all(resolved not in held for held in etcd_lab["nodes"]), (node, resolved)
    assert etcd_lab["etcd_in"] == [etcd_lab["infra_ns"]]


def test_a_job_meets_through_etcd(etcd_lab):
    result = etcd_lab["job"]
    assert result.returncode == 0, result.output[-3000:] + "\n".join(result.problems)
    report = result.last_json()
    assert report is not None and report["world"] == 2 and report["sum"] == 3.0, report


def test_etcd_and_its_namespace_are_gone_afterwards(etcd_lab):
    assert etcd_lab["run_id"] not in etcd_lab["netns"]
    assert leftovers(etcd_lab["run_id"]) == []


def _train(out: Path, steps: int, ckpt_every: int) -> list[str]:
    return [TRAIN, *TINY, "--steps", str(steps), "--ckpt-every", str(ckpt_every), "--out", str(out)]


@pytest.mark.slow
def test_node_0_lost_unannounced_the_job_finishes():
    """Node 0 (rank 0's node at the start) is killed from outside at step 6 of 12; with the
    rendezvous in etcd the survivors on node 1 go on (rank 0 is then on node 1), and with
    --replace-failed a fresh node 0 joins and the job finishes on 4 ranks."""
    _require_etcd()
    results = {}
    with Cluster(2, 2, "1gbit", rdzv="etcd") as lab:
        run_id = lab.run_id
        for name, replace in (("fewer", False), ("replaced", True)):
            killer = KillOnLine(lab.topology.node_namespaces[0], f"step {6:5d} |")
            results[name] = lab.run(
                _train(lab.shared_dir / name, 12, 3),
                max_restarts=3,
                min_nodes=1,
                replace_failed=replace,
                echo=killer,
                timeout=400,
            )
            assert killer.killed, name
            print(name, recovery_figures(results[name], killer), results[name].losses)
    for name, world in (("fewer", 2), ("replaced", 4)):
        result = results[name]
        assert result.returncode == 0, result.output[-4000:] + "\n".join(result.problems)
        report = result.last_json()
        assert report["steps"] == 12 and report["world_size"] == world, (name, report)
        [loss] = result.losses
        assert loss.node == 0 and "SIGKILL" in loss.cause, loss
        resumed = [int(s) for s in re.findall(r"resumed from \S+step-(\d+) at", result.output)]
        assert len(resumed) == 1 and 6 - resumed[0] <= 3, (name, resumed)
    assert leftovers(run_id) == []
