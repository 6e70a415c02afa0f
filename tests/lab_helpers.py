"""Shared pieces of the lab tests: the skip, and what a torn-down lab must not leave behind."""

from __future__ import annotations

import contextlib
import io
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from fsdp_ext.lab import unavailable_reason
from fsdp_ext.lab.cleanup import lab_runs, namespace_pids

PROGRAMS = Path(__file__).parent / "lab_programs"


def require_lab(*, storage: bool = True) -> None:
    """Skip, with the lab's own one-line reason, where the lab cannot run."""
    reason = unavailable_reason(storage=storage)
    if reason is not None:
        pytest.skip(reason)


def sshfs_mounts_of(run_id: str, extra_paths: tuple[str, ...] = ()) -> list[str]:
    """Every sshfs mount, in any process's mount namespace, that belongs to the run."""
    found = []
    for mountinfo in Path("/proc").glob("[0-9]*/mountinfo"):
        try:
            text = mountinfo.read_text()
        except OSError:
            continue
        for line in text.splitlines():
            if " - fuse.sshfs " in line and (
                run_id in line or any(f" {p} " in line for p in extra_paths)
            ):
                found.append(f"{mountinfo.parent.name}: {line}")
    return found


def alive(pids: list[int]) -> list[int]:
    """The pids that still run (a zombie has released its namespaces and mounts)."""
    out = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != "Z":
            out.append(pid)
    return out


def leftovers(run_id: str, *, pids: list[int] = (), shared_dir: str | None = None) -> list[str]:
    """Everything of run ``run_id`` still on the machine (empty once it is torn down)."""
    left = []
    runs = lab_runs()
    if run_id in runs:
        left.append(f"namespaces or files of {run_id}: {sorted(runs[run_id])}")
    left += [f"etc entry {p}" for p in Path("/etc/netns").glob(f"{run_id}-*")]
    for ns in runs.get(run_id, ()):
        left += [f"pid {p} in {ns}" for p in namespace_pids(ns)]
    extra = (shared_dir,) if shared_dir else ()
    left += [f"mount {m}" for m in sshfs_mounts_of(run_id, extra)]
    left += [f"process {p}" for p in alive(list(pids)) if p != os.getpid()]
    return left


def _parent(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])


def kill_from_outside(namespace: str, deadline_s: float = 10.0) -> list[int]:
    """A power loss the lab is not told of: every pid ``ip netns pids`` lists for
    ``namespace`` gets SIGKILL, once, and again only what those forked meanwhile (not a
    fresh node the lab starts there afterwards); the pids killed."""
    killed: set[int] = set()
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        out = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True)
        pids = [int(p) for p in out.stdout.split()]
        if killed:
            pids = [p for p in pids if p in killed or _parent(p) in killed]
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        killed.update(pids)
        time.sleep(0.02)
    return sorted(killed)


class KillOnLine(io.TextIOBase):
    """An ``echo`` for ``Cluster.run`` that kills node ``namespace`` from outside
    (``kill_from_outside``) when rank 0 first prints a line containing ``text``, and
    records when (seconds since the epoch) and what it killed; ``action`` replaces the kill
    (e.g. killing only the agent)."""

    def __init__(self, namespace: str, text: str, action=None):
        self.namespace, self.text = namespace, text
        self.action = action or (lambda: kill_from_outside(namespace))
        self.at: float | None = None
        self.killed: list[int] = []
        self.thread: threading.Thread | None = None

    def write(self, line: str) -> int:
        if self.at is None and self.text in line:
            self.at = time.time()
            self.thread = threading.Thread(target=self._strike, daemon=True)
            self.thread.start()
        return len(line)

    def _strike(self) -> None:
        self.killed = self.action()


def recovery_figures(result, killer: KillOnLine) -> dict:
    """Seconds from the kill to the lab finding the node lost, to the resume line, and to
    the first step after it."""
    at = killer.at - result.started_at
    found = {"found_s": round(result.losses[0].at_s - at, 2)} if result.losses else {}
    lines = result.output.splitlines(keepends=True)
    times = result.line_times
    resumed = next((i for i, ln in enumerate(lines) if ln.startswith("resumed from")), None)
    if resumed is None:
        return found
    step = next(i for i in range(resumed, len(lines)) if lines[i].startswith("step "))
    return {
        **found,
        "resume_s": round(times[resumed] - at, 1),
        "first_step_s": round(times[step] - at, 1),
        "resumed": lines[resumed].split(" at step")[0],
    }
