"""Removing a run's resources: on every exit of a lab, and for labs whose owner died.

A lab that is SIGKILLed cannot clean up after itself. Its namespaces, their processes
(sshd, sshfs, torchrun, ranks) and its working directory stay until the next lab starts
and finds resources of the ``fsdplab-`` prefix whose owner is no longer alive. Resources of
a live lab, and anything without the prefix, are never touched.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import time
from collections import defaultdict
from pathlib import Path

from fsdp_ext.lab.names import ETC_NETNS, PREFIX, RunNames
from fsdp_ext.lab.system import run_tool

__all__ = [
    "JOB_MARK",
    "clean_stale",
    "kill_marked",
    "lab_runs",
    "namespace_inode",
    "namespace_pids",
    "netns_pids",
    "remove_run",
    "teardown_on_termination",
]

JOB_MARK = "FSDP_EXT_LAB_JOB"  # in the environment of every process of one lab job

KILL_WAIT_S = 5.0


def workdir_root() -> Path:
    return RunNames(0, "000000").workdir.parent


def _netns_names() -> list[str]:
    out = run_tool(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def namespace_pids(ns: str) -> list[int]:
    """Live processes in network namespace ``ns`` (zombies hold no namespace)."""
    out = run_tool(["ip", "netns", "pids", ns], check=False).stdout
    return [int(p) for p in out.split() if p.isdigit()]


def namespace_inode(ns: str) -> int | None:
    """The inode that identifies network namespace ``ns`` (None once its name is gone);
    it still finds the namespace's processes after ``ip netns del`` took the name away."""
    try:
        return os.stat(Path("/run/netns") / ns).st_ino
    except OSError:
        return None


def netns_pids(inode: int) -> list[int]:
    """Live processes in the network namespace of ``inode``, named or not (what ``ip netns
    pids`` does for a named one)."""
    pids = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if os.stat(entry / "ns" / "net").st_ino == inode:
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


def lab_runs() -> dict[str, set[str]]:
    """Every lab run with resources on this machine: run id -> its namespace names."""
    runs: dict[str, set[str]] = defaultdict(set)
    for ns in _netns_names():
        names = RunNames.parse(ns)
        if names is not None:
            runs[names.run_id].add(ns)
    for root in (ETC_NETNS, workdir_root()):
        for path in root.glob(f"{PREFIX}-*") if root.is_dir() else []:
            names = RunNames.parse(path.name)
            if names is not None:  # a run with only files left is still a run
                runs.setdefault(names.run_id, set())
    return dict(runs)


def _kill_all(namespaces: list[str]) -> None:
    """SIGKILL every process in ``namespaces`` and wait until none is left."""
    deadline = time.monotonic() + KILL_WAIT_S
    while True:
        pids = [pid for ns in namespaces for pid in namespace_pids(ns)]
        if not pids or time.monotonic() > deadline:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)


def _marked(pid: int, mark: str) -> bool:
    try:
        return f"{JOB_MARK}={mark}".encode() in Path(f"/proc/{pid}/environ").read_bytes().split(
            b"\0"
        )
    except OSError:
        return False


def kill_marked(namespaces: list[str], mark: str) -> list[int]:
    """SIGKILL the processes of one job left in ``namespaces`` (torchrun starts its workers
    in sessions of their own, so stopping torchrun's group can leave them running)."""
    killed = []
    deadline = time.monotonic() + KILL_WAIT_S
    while time.monotonic() < deadline:
        pids = [p for ns in namespaces for p in namespace_pids(ns) if _marked(p, mark)]
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        killed += pids
        time.sleep(0.05)
    return sorted(set(killed))


def remove_run(names: RunNames, namespaces: list[str] | None = None) -> None:
    """Kill the run's processes, delete its namespaces, /etc/netns entries and workdir."""
    if namespaces is None:
        namespaces = sorted(lab_runs().get(names.run_id, ()))
    _kill_all(namespaces)
    for ns in namespaces:
        run_tool(["ip", "netns", "del", ns], check=False)
    for path in ETC_NETNS.glob(f"{names.run_id}-*") if ETC_NETNS.is_dir() else []:
        shutil.rmtree(path, ignore_errors=True)
    shutil.rmtree(names.workdir, ignore_errors=True)


def clean_stale() -> list[str]:
    """Remove the resources of every lab whose owner process is gone; return their run ids."""
    removed = []
    for run_id, namespaces in sorted(lab_runs().items()):
        names = RunNames.parse(run_id)
        if names is None or names.owner_is_alive():
            continue
        remove_run(names, sorted(namespaces))
        removed.append(run_id)
    return removed


def _unwind(signum, _frame):
    raise KeyboardInterrupt(f"signal {signum}")


def teardown_on_termination() -> None:
    """Make SIGTERM and SIGHUP unwind like Ctrl-C, so that a program's ``with Cluster(...)``
    tears its lab down when a scheduler, a timeout or a user stops it (by default both end
    the process at once and leave the lab running). For programs that build labs (the
    lab's CLI, the benchmarks); importing the library installs nothing."""
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _unwind)
