"""Shared storage: sshd in the storage namespace, sshfs at the same path inside every node.

The storage namespace serves one host directory over SFTP. Each node mounts it with sshfs,
over its own capped storage link, on the same path, inside a mount namespace of its own
(the one ``ip netns exec`` gives the sshfs process), so the host's view of the path is the
disk and a node's view is the network filesystem. The mount lives exactly as long as the
node's sshfs process: killing it (or the whole namespace) leaves no mount behind.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from fsdp_ext.lab.network import Topology, storage_addresses
from fsdp_ext.lab.requirements import SSHD
from fsdp_ext.lab.system import LabCommandError, niced, run_tool, start_daemon

__all__ = [
    "SSHFS_OPTIONS",
    "StorageServer",
    "fuse_mount_points",
    "mount_node_ram",
    "mount_shared",
    "start_sshd",
]

# no caching inside sshfs, and kernel attributes revalidated on every access: a file one
# node writes is seen at its full size by the next node that looks
SSHFS_OPTIONS = (
    "StrictHostKeyChecking=no,UserKnownHostsFile=/dev/null,BatchMode=yes,LogLevel=ERROR,"
    "dir_cache=no,attr_timeout=0,entry_timeout=0,negative_timeout=0"
)
READY_TIMEOUT_S = 20.0


class StorageServer:
    """Keys and config of one run's sshd, kept in the run's working directory."""

    def __init__(self, workdir: Path, shared_dir: Path):
        self.dir = workdir / "ssh"
        self.shared_dir = shared_dir
        self.client_key = self.dir / "client_key"

    def write_config(self, topology: Topology) -> Path:
        self.dir.mkdir(mode=0o700)
        for key in ("host_key", "client_key"):
            run_tool(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.dir / key)])
        (self.dir / "authorized_keys").write_text((self.dir / "client_key.pub").read_text())
        listen = [f"ListenAddress {storage_addresses(i)[1]}" for i in range(topology.nodes)]
        config = self.dir / "sshd_config"
        config.write_text(
            "\n".join(
                [
                    *listen,
                    f"HostKey {self.dir / 'host_key'}",
                    f"AuthorizedKeysFile {self.dir / 'authorized_keys'}",
                    "PermitRootLogin prohibit-password",
                    "PasswordAuthentication no",
                    "KbdInteractiveAuthentication no",
                    "UsePAM no",
                    # /tmp's modes (1777) upset sshd's checks of the key files' parents
                    "StrictModes no",
                    "PidFile none",
                    "MaxStartups 200",
                    "Subsystem sftp internal-sftp",
                ]
            )
            + "\n"
        )
        return config


def start_sshd(
    server: StorageServer, topology: Topology, log: Path, nice: int = 0
) -> subprocess.Popen:
    """sshd in the foreground inside the storage namespace, at ``nice`` (its sessions
    inherit it); returns once it listens."""
    config = server.write_config(topology)
    Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege separation dir
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [
                *niced(nice),
                "ip",
                "netns",
                "exec",
                topology.storage_namespace,
                SSHD,
                "-D",
                "-e",
                "-f",
                str(config),
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    _wait_for(lambda: "Server listening" in log.read_text(errors="replace"), proc, log, "sshd")
    return proc


def mount_shared(
    server: StorageServer, topology: Topology, node: int, log: Path
) -> subprocess.Popen:
    """sshfs (foreground) in node ``node``'s namespace; returns once the mount is there.

    The returned process's mount namespace is the node's: run things in the node with
    ``nsenter --target PID --mount ip netns exec NODE ...`` to see the shared directory.
    """
    _, storage_side = storage_addresses(node)
    path = str(server.shared_dir)
    argv = ["ip", "netns", "exec", topology.node_namespaces[node], "sshfs", "-f", "-F", "/dev/null"]
    argv += ["-o", f"IdentityFile={server.client_key},{SSHFS_OPTIONS}"]
    argv += [f"root@{storage_side}:{path}", path]
    proc = start_daemon(argv, log)
    _wait_for(lambda: path in fuse_mount_points(proc.pid), proc, log, f"sshfs on node {node}")
    return proc


def mount_node_ram(pid: int) -> None:
    """A /dev/shm of the node's own in the mount namespace of process ``pid`` (the node's
    sshfs): what a node keeps in RAM (in-memory snapshots) is its alone, another node
    cannot read it, and it is gone with the node (the namespace, and its tmpfs, die with
    its last process), as a power loss takes a real node's RAM."""
    tmpfs = ["mount", "-t", "tmpfs", "-o", "mode=1777,nosuid,nodev", "fsdp_ext_lab_shm"]
    run_tool(["nsenter", f"--target={pid}", "--mount", "--", *tmpfs, "/dev/shm"])


def fuse_mount_points(pid: int) -> list[str]:
    """Mount points of sshfs filesystems seen by process ``pid`` (from its mountinfo)."""
    try:
        lines = Path(f"/proc/{pid}/mountinfo").read_text().splitlines()
    except OSError:
        return []
    points = []
    for line in lines:
        left, _, right = line.partition(" - ")
        if right.startswith("fuse.sshfs "):
            points.append(left.split()[4])
    return points


def _wait_for(ready, proc: subprocess.Popen, log: Path, what: str) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not ready():
        if proc.poll() is not None or time.monotonic() > deadline:
            tail = log.read_text(errors="replace").strip().splitlines()[-3:]
            state = "exited" if proc.poll() is not None else "did not come up"
            raise LabCommandError(f"{what} {state}: {' | '.join(tail) or 'no output'}")
        time.sleep(0.05)
