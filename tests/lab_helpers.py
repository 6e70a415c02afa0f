"""Shared pieces of the lab tests: the skip, and what a torn-down lab must not leave behind."""

from __future__ import annotations

import os
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
