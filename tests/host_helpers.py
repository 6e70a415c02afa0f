"""A second "host" on this machine: its own UTS and mount namespace, host name, boot id and
/etc/hosts entry (FACTS.md), and a power loss there: SIGKILL of every process in it."""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import subprocess
import uuid
from pathlib import Path

import pytest


def require_unshare() -> None:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("a second host needs root and unshare(1)")


def start_on_host(tmp_path: Path, name: str, argv: list[str], **popen) -> subprocess.Popen:
    """Run ``argv`` on host ``name``: a fresh boot id, its name in /etc/hosts."""
    require_unshare()
    boot_id = tmp_path / f"{name}.boot_id"
    boot_id.write_text(f"{uuid.uuid4()}\n")
    hosts = tmp_path / f"{name}.hosts"
    hosts.write_text(Path("/etc/hosts").read_text() + f"\n127.0.0.1 {name}\n")
    script = (
        f"hostname {name} && mount --bind {boot_id} /proc/sys/kernel/random/boot_id && "
        f"mount --bind {hosts} /etc/hosts && exec {shlex.join(argv)}"
    )
    cmd = ["unshare", "--uts", "--mount", "--propagation", "private", "bash", "-c", script]
    return subprocess.Popen(cmd, **popen)


def power_off(proc: subprocess.Popen) -> list[int]:
    """SIGKILL every process sharing ``proc``'s UTS namespace; returns their pids."""
    ns = os.readlink(f"/proc/{proc.pid}/ns/uts")
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.readlink(entry / "ns" / "uts") == ns:
                    pids.append(int(entry.name))
            except OSError:
                continue
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait(30)
    return pids
