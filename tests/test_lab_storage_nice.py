"""The storage node's servers at a nice value of their own (``Cluster(storage_nice=...)``),
read from outside: every process in the storage namespace (sshd and its sessions) runs at
that value, every process on a node (sshfs, its ssh) at the default."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from fsdp_ext.lab import Cluster
from tests.lab_helpers import require_lab


def _nice_by_command(namespace: str) -> dict[str, list[int]]:
    pids = subprocess.run(
        ["ip", "netns", "pids", namespace], capture_output=True, text=True, check=True
    ).stdout.split()
    out: dict[str, list[int]] = {}
    for pid in pids:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:  # ended meanwhile
            continue
        command = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        out.setdefault(command, []).append(int(fields[16]))  # field 19 of proc(5): nice
    return out


@pytest.mark.parametrize("nice", [0, 19])
def test_the_storage_nodes_servers_run_at_storage_nice_and_the_nodes_at_the_default(nice):
    require_lab()
    with Cluster(1, 1, "100mbit", storage_nice=nice) as lab:
        assert (lab.shared_dir / "seen").write_text("x") == 1  # sshfs has a session open
        # on a loaded machine the session's process can be between fork and exec, or sshfs
        # reconnecting, at one reading: read again (for up to 10 s) until it shows
        deadline = time.monotonic() + 10
        while True:
            storage = _nice_by_command(lab.topology.storage_namespace)
            if len(storage.get("sshd", [])) >= 2 or time.monotonic() > deadline:
                break
            (lab.shared_dir / "seen").read_text()
            time.sleep(0.2)
        node = _nice_by_command(lab.topology.node_namespaces[0])
    # the listener and the node's session (sftp runs inside it: internal-sftp)
    assert len(storage.get("sshd", [])) >= 2, storage
    assert {n for ns in storage.values() for n in ns} == {nice}, storage
    assert "sshfs" in node and "ssh" in node, node
    assert {n for ns in node.values() for n in ns} == {0}, node


@pytest.mark.parametrize("bad", [20, -1, True, 1.5])
def test_a_storage_nice_out_of_range_is_refused_before_anything_is_built(bad):
    with pytest.raises(ValueError, match=r"^storage_nice must be an int from 0 to 19, got "):
        Cluster(storage_nice=bad)
