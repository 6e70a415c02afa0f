"""Faults struck from outside a running job, as the real failure would strike.

- ``kill-node I``: SIGKILL to every process in node I's network namespace (a power loss:
  its torchrun, its ranks, its sshfs), repeated until none is left;
- ``kill-rank R``: SIGKILL to the worker of global rank R (found by its ``RANK``);
- ``link-down I``: node I's link loses its carrier for ``duration_s`` (``ip link set
  down``, then up: every frame in between is lost; ``tc``'s netem, which would drop them
  instead, is missing from this kernel);
- ``storage-down I``: node I's sshfs dies, so its shared directory answers ENOTCONN.

A fault strikes ``after_s`` seconds into the job, or when node 0's console (rank 0's
output) first shows a line containing ``on_output`` (after the previous fault struck).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from fsdp_ext.lab.cleanup import namespace_pids
from fsdp_ext.lab.network import FABRIC_DEVICE
from fsdp_ext.lab.system import run_tool

__all__ = [
    "FAULT_KINDS",
    "Fault",
    "FaultEvent",
    "FaultInjector",
    "kill_namespace",
    "link_down",
    "process_environ",
    "rank_pids",
]

FAULT_KINDS = ("kill-node", "kill-rank", "link-down", "storage-down")
KILL_DEADLINE_S = 10.0
POLL_S = 0.02


@dataclass(frozen=True)
class Fault:
    """One fault: what (``kind``), where (node index, or global rank for kill-rank), when."""

    kind: str
    target: int
    after_s: float | None = None
    on_output: str | None = None
    duration_s: float | None = None  # link-down only: how long the link stays down

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ValueError(
                f"fault kind must be one of {', '.join(FAULT_KINDS)}, got {self.kind!r}"
            )
        if isinstance(self.target, bool) or not isinstance(self.target, int) or self.target < 0:
            raise ValueError(f"{self.kind}: the target must be an int >= 0, got {self.target!r}")
        if (self.after_s is None) == (self.on_output is None):
            raise ValueError(f"{self.kind}: give exactly one of after_s (seconds) or on_output")
        if self.after_s is not None and not self.after_s >= 0:
            raise ValueError(f"{self.kind}: after_s must be >= 0 seconds, got {self.after_s!r}")
        if self.kind == "link-down":
            if self.duration_s is None or not self.duration_s > 0:
                raise ValueError(f"link-down needs a duration > 0 seconds, got {self.duration_s!r}")
        elif self.duration_s is not None:
            raise ValueError(f"{self.kind}: only link-down takes a duration")

    def describe(self) -> str:
        what = f"rank {self.target}" if self.kind == "kill-rank" else f"node {self.target}"
        when = f"after {self.after_s:g} s" if self.after_s is not None else f"at {self.on_output!r}"
        extra = f" for {self.duration_s:g} s" if self.duration_s is not None else ""
        return f"{self.kind} {what}{extra} {when}"


@dataclass(frozen=True)
class FaultEvent:
    """What the lab did, when (seconds after the job started)."""

    fault: Fault
    at_s: float
    note: str


def process_environ(pid: int) -> dict[str, str]:
    """The environment process ``pid`` started with (empty once it is gone), read from
    ``/proc``: how a rank's processes are told apart from the outside."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    pairs = (item.partition(b"=") for item in raw.split(b"\0") if item)
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, _, v in pairs}


def rank_pids(namespace: str, rank: int) -> list[int]:
    """Processes in ``namespace`` whose environment says they are global rank ``rank``."""
    return [p for p in namespace_pids(namespace) if process_environ(p).get("RANK") == str(rank)]


def parent_pid(pid: int) -> int | None:
    """``pid``'s parent (field 4 of /proc/PID/stat), None once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat[stat.rindex(")") + 2 :].split()[1])


def kill_namespace(namespace: str) -> int:
    """SIGKILL every process of ``namespace`` now, as a power loss strikes once; how many.

    The kill is repeated only for those processes and for what they forked while it ran,
    never for a process started afterwards by someone else (a fresh node the lab starts
    in the same namespace at once)."""
    killed: set[int] = set()
    deadline = time.monotonic() + KILL_DEADLINE_S
    while time.monotonic() < deadline:
        pids = [
            pid
            for pid in namespace_pids(namespace)
            if not killed or pid in killed or parent_pid(pid) in killed
        ]
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        killed.update(pids)
        time.sleep(POLL_S)
    return len(killed)


@dataclass
class FaultInjector:
    """Strikes ``faults`` in order on a thread; calls back into the lab for what follows."""

    faults: list[Fault]
    output: list[str]  # node 0's console lines, as they come
    start: float
    strike: object  # callable (Fault) -> str: does it, returns the note
    events: list[FaultEvent] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def begin(self) -> None:
        if self.faults:
            self._thread = threading.Thread(target=self._run, daemon=True, name="lab-faults")
            self._thread.start()

    def end(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=KILL_DEADLINE_S + 5)

    def _due(self, fault: Fault, seen: int) -> tuple[bool, int]:
        if fault.after_s is not None:
            return time.monotonic() - self.start >= fault.after_s, seen
        lines = self.output[seen:]
        return any(fault.on_output in line for line in lines), seen + len(lines)

    def _run(self) -> None:
        seen = 0  # a fault's output trigger reads the lines after the previous fault's strike
        for fault in self.faults:
            while True:
                due, seen = self._due(fault, seen)
                if due:
                    break
                if self._stop.wait(POLL_S):
                    return
            at = time.monotonic() - self.start
            try:
                note = self.strike(fault)
            except Exception as exc:  # reported with the result, never a silent thread death
                self.errors.append(f"{fault.describe()}: {exc}")
                continue
            self.events.append(FaultEvent(fault, round(at, 3), note))


def link_down(namespace: str, seconds: float, stop: threading.Event | None = None) -> None:
    """Node link without carrier for ``seconds``, then back (routes come back with it)."""
    run_tool(["ip", "-n", namespace, "link", "set", FABRIC_DEVICE, "down"])
    try:
        (stop or threading.Event()).wait(seconds)
    finally:
        run_tool(["ip", "-n", namespace, "link", "set", FABRIC_DEVICE, "up"])


def kill_process(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        proc.wait()
