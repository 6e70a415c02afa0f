"""This machine's processes, as a lock judges its holder: the kernel's boot id, when a pid
started, whether it runs. Read from ``/proc``, which is the kernel, not checkpoint storage:
the one module besides the storage implementation that reads a file."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["boot_id", "pid_running", "process_start"]


def boot_id() -> str:
    """This boot's id ("" where the kernel does not say): a host name can come back after a
    reboot with none of its processes."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def process_start(pid: int) -> str:
    """The start time of ``pid`` in clock ticks since boot, or "" if it is not running."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    # the command name (field 2) may hold spaces; fields after it are plain
    return stat.rpartition(")")[2].split()[19]


def pid_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
