"""Striking the chaos schedule from outside the job, as the real failures would.

Nothing here goes through the lab's own fault options: every fault finds its processes with
``ip netns pids`` (and ``/proc``) and signals them, and the lab's supervision has to find out
for itself. A ``Striker`` is the job's ``echo``: it sees rank 0's lines as they come, and a
thread of its own strikes each fault when its trigger line shows (after the previous fault
finished). A stopped process is always continued, whatever happens to the benchmark.
"""

from __future__ import annotations

import contextlib
import io
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.chaos_schedule import ChaosFault
from fsdp_ext.lab import kill_namespace, link_down, namespace_pids, rank_pids

__all__ = ["LINK_DOWN_S", "STORAGE_STALL_S", "Striker", "Struck"]

LINK_DOWN_S = 5.0
STORAGE_STALL_S = 10.0
POLL_S = 0.02


@dataclass(frozen=True)
class Struck:
    """A fault as struck: when it began and ended (seconds since the epoch), what was done."""

    fault: ChaosFault
    at: float
    done: float
    note: str


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def _program(pid: int) -> str:
    return Path((_cmdline(pid) or [""])[0]).name


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def _stopped(pids: list[int], seconds: float, stop: threading.Event) -> None:
    """SIGSTOP ``pids`` for ``seconds`` (or until ``stop``), then SIGCONT, always."""
    _signal_all(pids, signal.SIGSTOP)
    try:
        stop.wait(seconds)
    finally:
        _signal_all(pids, signal.SIGCONT)


class Striker(io.TextIOBase):
    """Strikes ``faults`` in order on the nodes ``namespaces`` (by index); ``pause_s``: how
    long a node-pause lasts (two leases of the job's checkpoint lock)."""

    def __init__(self, namespaces: list[str], faults: list[ChaosFault], pause_s: float):
        self.namespaces, self.faults, self.pause_s = namespaces, list(faults), pause_s
        self.lines: list[tuple[float, str]] = []  # rank 0's lines, with when they came
        self.struck: list[Struck] = []
        self.failures: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="chaos")

    # the job's echo
    def write(self, text: str) -> int:
        with self._lock:
            self.lines.append((time.time(), text))
        return len(text)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.pause_s + 30)

    def _run(self) -> None:
        seen = 0
        for fault in self.faults:
            while not self._stop.is_set():
                with self._lock:
                    fresh = self.lines[seen:]
                seen += len(fresh)
                if any(fault.trigger in text for _, text in fresh):
                    break
                time.sleep(POLL_S)
            if self._stop.is_set():
                return
            at = time.time()
            try:
                note = self.strike(fault)
            except Exception as exc:  # reported with the result, never a silent thread death
                self.failures.append(f"{fault.describe()}: {exc}")
                continue
            self.struck.append(Struck(fault, at, time.time(), note))
            with self._lock:  # the next trigger looks only at lines after this fault
                seen = len(self.lines)

    def strike(self, fault: ChaosFault) -> str:
        """Do ``fault`` now (timed faults return when they are over); what was done."""
        if fault.kind == "rank-kill":
            pids = [p for ns in self.namespaces for p in rank_pids(ns, fault.target)]
            _signal_all(pids, signal.SIGKILL)
            return f"SIGKILL to rank {fault.target}'s processes {pids}"
        ns = self.namespaces[fault.target]
        node = f"node {fault.target}"
        if fault.kind in ("node-loss", "save-kill", "load-kill"):
            return f"SIGKILL to all {kill_namespace(ns)} processes of {node}"
        if fault.kind == "agent-kill":
            agents = [p for p in namespace_pids(ns) if "torch.distributed.run" in _cmdline(p)]
            _signal_all(agents, signal.SIGKILL)
            return f"SIGKILL to {node}'s torchrun agent {agents}"
        if fault.kind == "link-down":
            link_down(ns, LINK_DOWN_S, self._stop)
            return f"{node}'s link down for {LINK_DOWN_S:g} s"
        if fault.kind == "storage-stall":
            sshfs = [p for p in namespace_pids(ns) if _program(p) == "sshfs"]
            if not sshfs:
                raise RuntimeError(f"{node} has no sshfs process to stop")
            _stopped(sshfs, STORAGE_STALL_S, self._stop)
            return f"{node}'s sshfs {sshfs} stopped for {STORAGE_STALL_S:g} s"
        if fault.kind == "node-pause":
            pids = namespace_pids(ns)
            _stopped(pids, self.pause_s, self._stop)
            return f"all {len(pids)} processes of {node} stopped for {self.pause_s:g} s"
        raise ValueError(f"unknown fault kind {fault.kind!r}")
