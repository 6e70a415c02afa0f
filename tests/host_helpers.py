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


def on_host(tmp_path: Path, name: str, argv: list[str], *, own_boot: bool = True) -> list[str]:
    """``argv`` wrapped to run on host ``name``: its own UTS and mount namespace, host name
    and /etc/hosts entry, and a fresh boot id (``own_boot=False``: this kernel's, as two
    containers on one machine share it)."""
    require_unshare()
    boot_id = tmp_path / f"{name}.boot_id"
    boot_id.write_text(f"{uuid.uuid4()}\n")
    hosts = tmp_path / f"{name}.hosts"
    hosts.write_text(Path("/etc/hosts").read_text() + f"\n127.0.0.1 {name}\n")
    boot = f"mount --bind {boot_id} /proc/sys/kernel/random/boot_id && " if own_boot else ""
    script = f"hostname {name} && {boot}mount --bind {hosts} /etc/hosts && exec {shlex.join(argv)}"
    return ["unshare", "--uts", "--mount", "--propagation", "private", "bash", "-c", script]


def start_on_host(
    tmp_path: Path, name: str, argv: list[str], *, own_boot: bool = True, **popen
) -> subprocess.Popen:
    """Run ``argv`` on host ``name`` (:func:`on_host`)."""
    return subprocess.Popen(on_host(tmp_path, name, argv, own_boot=own_boot), **popen)


def host_pids(proc: subprocess.Popen) -> list[int]:
    """Every process sharing ``proc``'s UTS namespace: that host's processes."""
    ns = os.readlink(f"/proc/{proc.pid}/ns/uts")
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.readlink(entry / "ns" / "uts") == ns:
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


def signal_host(proc: subprocess.Popen, sig: int) -> list[int]:
    """Send ``sig`` to every process of ``proc``'s host (SIGSTOP: a frozen VM)."""
    pids = host_pids(proc)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
    return pids


def power_off(proc: subprocess.Popen) -> list[int]:
    """SIGKILL every process sharing ``proc``'s UTS namespace; returns their pids."""
    pids = signal_host(proc, signal.SIGKILL)
    proc.wait(30)
    return pids
