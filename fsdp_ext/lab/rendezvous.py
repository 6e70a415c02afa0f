"""The rendezvous server of ``--rdzv etcd``: Debian's etcd in the infrastructure namespace.

torchrun's c10d rendezvous keeps its store in node 0's agent, so losing node 0 ends every
job. A real cluster keeps the rendezvous where no training runs (an etcd service); here that
is the lab's infrastructure namespace, reached by every node over a management link of its
own as ``rendezvous:2379`` (torchrun's ``etcd-v2`` backend, the v2 API of etcd 3.4).
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import time
from pathlib import Path

from fsdp_ext.lab.network import ETCD_CLIENT_PORT, Topology
from fsdp_ext.lab.system import LabCommandError, start_daemon

__all__ = ["ETCD", "ETCD_INSTALL", "etcd_missing", "start_etcd"]

ETCD = "etcd"
ETCD_INSTALL = (
    "apt-get install -y etcd-server (Debian's etcd 3.4; or scripts/lab-packages.sh) and "
    "pip install python-etcd==0.4.5 (torchrun's etcd-v2 backend)"
)
READY_TIMEOUT_S = 30.0
READY_LINE = "ready to serve client requests"


def etcd_missing() -> list[str]:
    """What ``--rdzv etcd`` needs and this machine lacks (the server, the Python client)."""
    missing = [] if shutil.which(ETCD) else ["etcd (Debian package etcd-server)"]
    if importlib.util.find_spec("etcd") is None:
        missing.append("python-etcd (PyPI)")
    return missing


def start_etcd(topology: Topology, workdir: Path, log: Path) -> subprocess.Popen:
    """etcd in the foreground in the infrastructure namespace, its data in ``workdir``;
    returns once it serves clients on every management link (port 2379)."""
    data = workdir / "etcd"
    argv = ["ip", "netns", "exec", topology.infra_namespace, ETCD, "--name", "lab"]
    argv += ["--data-dir", str(data), "--enable-v2=true"]
    argv += ["--listen-client-urls", f"http://0.0.0.0:{ETCD_CLIENT_PORT}"]
    argv += ["--advertise-client-urls", f"http://{topology.rendezvous_endpoint}"]
    # one member: its peer port stays on the namespace's loopback
    peer = "http://127.0.0.1:2380"
    argv += ["--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer]
    argv += ["--initial-cluster", f"lab={peer}"]
    proc = start_daemon(argv, log)
    deadline = time.monotonic() + READY_TIMEOUT_S
    while READY_LINE not in log.read_text(errors="replace"):
        if proc.poll() is not None or time.monotonic() > deadline:
            tail = log.read_text(errors="replace").strip().splitlines()[-3:]
            state = "exited" if proc.poll() is not None else "did not come up"
            raise LabCommandError(f"etcd {state}: {' | '.join(tail) or 'no output'} ({log})")
        time.sleep(0.05)
    return proc
