"""One --out on the lab's shared sshfs directory, written from two lab nodes that are two
hosts (their own host names and boot ids): the heartbeat must be seen to move over sshfs."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from fsdp_ext.checkpoint import checkpoint_steps
from fsdp_ext.lab import Cluster
from fsdp_ext.warm import CLIENT
from tests.host_helpers import on_host, power_off
from tests.lab_helpers import leftovers, require_lab
from tests.test_train_job_life import TINY

REPO = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(REPO)}
CLAIM = str(Path(__file__).parent / "ckpt_programs" / "claim_out.py")


def test_two_lab_nodes_share_one_out_on_sshfs_one_owner_at_a_time(tmp_path, warm_server_socket):
    """The three programs are forks of the session's warm server (fsdp_ext/warm), each
    joining its node's network and mount namespaces (the sshfs view) and its host's name."""
    require_lab()
    lease = 3.0
    warm = [sys.executable, str(CLIENT), "--socket", warm_server_socket]
    with Cluster(2, 1, "1gbit") as lab:
        out = lab.shared_dir / "run"
        root = out / "checkpoints"
        flags = ["--steps", "100000", "--ckpt-every", "5", "--keep", "2", "--lease", str(lease)]
        train = [*warm, str(REPO / "examples" / "train.py"), *TINY.split(), *flags]
        a = lab.popen(
            0,
            on_host(tmp_path, "node-a", [*train, "--out", str(out)]),
            env=ENV,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            deadline = time.monotonic() + 180
            while not checkpoint_steps(root):  # the host's view of the shared directory
                assert a.poll() is None and time.monotonic() < deadline, a.stderr.read()[-3000:]
                time.sleep(0.2)
            second = lab.exec(
                1,
                on_host(tmp_path, "node-b", [*train, "--out", str(out)]),
                env=ENV,
                check=False,
                timeout=180,
            )
            assert second.returncode == 2, second.stderr[-3000:]
            assert "fresh interpreter" not in second.stderr  # a fork, not the fallback
            (line,) = [x for x in second.stderr.splitlines() if "error" in x]
            assert "owned by a live job" in line and "on host node-a" in line, line
            assert "step " not in second.stdout
        finally:
            killed = power_off(a)
        assert killed
        t0 = time.monotonic()
        claimant = subprocess.run(
            lab.node_command(
                1, on_host(tmp_path, "node-c", [*warm, CLAIM, str(root), str(lease), "try"])
            ),
            env=ENV,
            capture_output=True,
            text=True,
            timeout=180,
            input="claim\n",
        )
        since_kill = time.monotonic() - t0
        run_id = lab.run_id
    assert claimant.returncode == 0, claimant.stderr[-3000:]
    assert "fresh interpreter" not in claimant.stderr
    took = json.loads(claimant.stdout.splitlines()[-1])
    assert took.get("took") == 2, took
    assert lease <= took["s"] <= lease + lease / 4 + 1.5, took
    assert leftovers(run_id) == []
    print(
        json.dumps({"lease_s": lease, "claim_s": round(took["s"], 2), "since_kill_s": since_kill})
    )
