"""torchrun on every node, as a real multi-node launch: one agent per node, c10d rendezvous
on node 0's link address, gloo bound to the node's link.

Node 0's console is streamed (it carries rank 0's output); the others go to log files.
The job ends when every node's torchrun has exited, or as soon as one fails (the others are
stopped, as a cluster scheduler would), or at the deadline.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from fsdp_ext.lab.network import FABRIC_DEVICE, Topology

__all__ = [
    "RDZV_BACKENDS",
    "RDZV_PORT",
    "Job",
    "node_env",
    "rank_logs",
    "start_job",
    "torchrun_argv",
]

RDZV_PORT = 29400
RDZV_BACKENDS = ("c10d", "static")
STOP_GRACE_S = 10.0
TIMED_OUT = 124  # the exit status of timeout(1)


def torchrun_argv(
    topology: Topology,
    node: int,
    ranks_per_node: int,
    program: Sequence[str],
    *,
    rdzv: str,
    python: str,
    log_dir: Path,
) -> list[str]:
    """The torchrun command line node ``node`` runs (``program`` is SCRIPT ARGS...).

    Every rank's stdout and stderr go to files under ``log_dir``; node 0 also copies its
    local rank 0's (global rank 0's) lines to its console, prefixed ``[default0]:``.
    """
    argv = [python, "-m", "torch.distributed.run", "--nnodes", str(topology.nodes)]
    argv += ["--nproc-per-node", str(ranks_per_node), "--max-restarts", "0"]
    argv += ["--log-dir", str(log_dir), "--redirects", "3"]
    if node == 0:
        argv += ["--tee", "3", "--local-ranks-filter", "0"]
    master = topology.node_address(0)
    if topology.nodes == 1:
        argv += ["--standalone"]
    elif rdzv == "c10d":
        # is_host: node 0 serves the rendezvous store (torchrun cannot tell by hostname here);
        # --local-addr orders the nodes, so node k gets GROUP_RANK k
        argv += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"{master}:{RDZV_PORT}"]
        argv += ["--rdzv-id", topology.names.run_id, "--rdzv-conf", f"is_host={int(node == 0)}"]
        argv += ["--local-addr", topology.node_address(node)]
    else:
        argv += ["--node-rank", str(node), "--master-addr", master]
        argv += ["--master-port", str(RDZV_PORT)]
    return argv + list(program)


def node_env(base: dict[str, str], topology: Topology, ranks_per_node: int) -> dict[str, str]:
    """The environment of every node's torchrun: gloo on the node's link, one thread share."""
    env = dict(base)
    env["GLOO_SOCKET_IFNAME"] = FABRIC_DEVICE if topology.nodes > 1 else "lo"
    env.setdefault("PYTHONUNBUFFERED", "1")
    # the nodes share this machine's cores; each rank gets its share, not all of them
    cores = os.cpu_count() or 1
    env.setdefault("OMP_NUM_THREADS", str(max(1, cores // (topology.nodes * ranks_per_node))))
    return env


@dataclass
class Job:
    """The torchrun processes of one run, and rank 0's lines from node 0's console."""

    procs: list[subprocess.Popen]
    logs: list[Path]
    output: list[str] = field(default_factory=list)
    reader: threading.Thread | None = None

    def wait(self, deadline: float) -> tuple[int, bool]:
        """(exit status, timed out): the first failing node's status, else 0."""
        failed = None
        while True:
            codes = [p.poll() for p in self.procs]
            failed = next((c for c in codes if c not in (None, 0)), None)
            if failed is not None or all(c == 0 for c in codes):
                break
            if time.monotonic() > deadline:
                self.stop()
                return TIMED_OUT, True
            time.sleep(0.05)
        self.stop()
        return (failed or 0), False

    def stop(self) -> None:
        """SIGTERM every node's torchrun (it stops its ranks), SIGKILL after a grace period."""
        for proc in self.procs:
            _signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(proc, signal.SIGKILL)
                proc.wait()
        if self.reader is not None:
            self.reader.join(timeout=STOP_GRACE_S)


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)


RANK0_PREFIX = "[default0]:"  # torchrun's prefix for the lines of local rank 0 it tees


def _pump(stream, log: Path, rank0: list[str], echo: TextIO | None) -> None:
    """Copy node 0's console to its log; keep (and echo) rank 0's lines without the prefix."""
    with open(log, "w") as out:
        for line in stream:
            out.write(line)
            out.flush()
            if line.startswith(RANK0_PREFIX):
                line = line[len(RANK0_PREFIX) :]
                rank0.append(line)
            if echo is not None:
                echo.write(line)
                echo.flush()


def rank_logs(log_dir: Path, local_rank: int) -> tuple[str, str]:
    """(stdout, stderr) of one local rank, from the files torchrun wrote under ``log_dir``."""
    texts = []
    for name in ("stdout.log", "stderr.log"):
        files = sorted(log_dir.glob(f"*/attempt_*/{local_rank}/{name}"))
        texts.append("".join(f.read_text(errors="replace") for f in files))
    return texts[0], texts[1]


def start_job(
    commands: list[list[str]],
    env: dict[str, str],
    logdir: Path,
    *,
    echo: TextIO | None = None,
) -> Job:
    """Start one command per node (node 0's console piped and pumped, others to files)."""
    procs, logs = [], []
    job = Job(procs, logs)
    for node, argv in enumerate(commands):
        log = logdir / f"node{node}.log"
        logs.append(log)
        if node == 0:
            proc = subprocess.Popen(
                argv,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                text=True,
                errors="replace",
                start_new_session=True,  # Ctrl-C reaches the lab, which stops the job in order
            )
            job.reader = threading.Thread(
                target=_pump, args=(proc.stdout, log, job.output, echo), daemon=True
            )
            job.reader.start()
        else:
            with open(log, "w") as out:
                proc = subprocess.Popen(
                    argv,
                    env=env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
        procs.append(proc)
    return job
