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
    "Elastic",
    "Job",
    "node_env",
    "rank_logs",
    "start_job",
    "start_node",
    "torchrun_argv",
]

RDZV_PORT = 29400
RDZV_BACKENDS = ("c10d", "static")
STOP_GRACE_S = 10.0
TIMED_OUT = 124  # the exit status of timeout(1)
LOST = 125  # the lab took down a node the job could not do without


@dataclass(frozen=True)
class Elastic:
    """torchrun's elastic options: restarts after a failure, and how few nodes may go on."""

    max_restarts: int = 0
    min_nodes: int | None = None  # None: every node (a fixed-size job)

    def nnodes(self, nodes: int) -> str:
        low = nodes if self.min_nodes is None else self.min_nodes
        return str(nodes) if low == nodes else f"{low}:{nodes}"

    @property
    def on(self) -> bool:
        """Whether a lost rank or node may be survived (else the first failure ends the job)."""
        return self.max_restarts > 0


# c10d rendezvous settings for a lab: a node whose agent misses 3 keep-alives of 1 s is
# dead; once the fewest nodes have joined, the others get 1 s to join too. That second is
# a survivor's wait on every restart (torchrun's default is 30 s; measured: 5 s of a
# 13-18 s restart). A node that comes later (a replacement) waits for the next round,
# which its arrival starts at once (the agents restart for a waiting node).
RDZV_CONF = "keep_alive_interval=1,keep_alive_max_attempt=3,last_call_timeout=1"


def torchrun_argv(
    topology: Topology,
    node: int,
    ranks_per_node: int,
    program: Sequence[str],
    *,
    rdzv: str,
    python: str,
    log_dir: Path,
    elastic: Elastic = Elastic(),
) -> list[str]:
    """The torchrun command line node ``node`` runs (``program`` is SCRIPT ARGS...).

    Every rank's stdout and stderr go to files under ``log_dir``; node 0 also copies its
    local rank 0's (global rank 0's) lines to its console, prefixed ``[default0]:``.
    """
    nnodes = elastic.nnodes(topology.nodes)
    argv = [python, "-m", "torch.distributed.run", "--nnodes", nnodes]
    argv += ["--nproc-per-node", str(ranks_per_node), "--max-restarts", str(elastic.max_restarts)]
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
        # a fixed-size job keeps torchrun's defaults (fewer keep-alives on the measured link)
        conf = f"is_host={int(node == 0)}" + (f",{RDZV_CONF}" if elastic.on else "")
        argv += ["--rdzv-id", topology.names.run_id, "--rdzv-conf", conf]
        argv += ["--local-addr", topology.node_address(node)]
    else:
        argv += ["--node-rank", str(node), "--master-addr", master]
        argv += ["--master-port", str(RDZV_PORT)]
    return argv + list(program)


def node_env(base: dict[str, str], topology: Topology, ranks_per_node: int) -> dict[str, str]:
    """The environment of every node's torchrun: gloo on the node's link, one thread share."""
    env = dict(base)
    env["GLOO_SOCKET_IFNAME"] = FABRIC_DEVICE if topology.nodes > 1 else "lo"
    # Each rendezvous round gets a store of its own, hosted by that round's rank 0 worker.
    # torchrun's default shares one store server, started by node 0's agent in the first
    # round, with the workers of every round: its keys outlive the round (a restarted
    # round's gloo reads the dead workers' addresses: "connectFullMesh failed ... Connection
    # closed by peer"), and the agent never publishes its address again, so a node that
    # joins a later round waits for it until the rendezvous times out.
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    env.setdefault("PYTHONUNBUFFERED", "1")
    # the nodes share this machine's cores; each rank gets its share, not all of them
    cores = os.cpu_count() or 1
    env.setdefault("OMP_NUM_THREADS", str(max(1, cores // (topology.nodes * ranks_per_node))))
    return env


@dataclass
class Job:
    """The torchrun processes of one run (one per node), and rank 0's lines from node 0's
    console. ``elastic``: a node the lab itself took down (``lose``) is not a failure of
    the job, whose survivors go on; otherwise the first torchrun to fail ends the job."""

    procs: list[subprocess.Popen]
    logs: list[Path]
    output: list[str] = field(default_factory=list)
    times: list[float] = field(default_factory=list)  # when each output line came (monotonic)
    reader: threading.Thread | None = None
    elastic: bool = False
    lost: set[int] = field(default_factory=set)  # nodes the lab took down, not replaced
    retired: list[subprocess.Popen] = field(default_factory=list)  # torchruns of lost nodes
    doomed: str | None = None  # why the job cannot go on (set by the lab), or None

    def lose(self, node: int, why: str | None = None) -> None:
        """Node ``node`` was taken down by the lab; ``why`` says so when that ends the job."""
        self.lost.add(node)
        if why is not None or not self.elastic:
            self.doomed = why or f"node {node} was lost and the job is not elastic"

    def replace(self, node: int, proc: subprocess.Popen) -> None:
        """A fresh torchrun on node ``node`` in place of the lost one."""
        self.retired.append(self.procs[node])
        self.procs[node] = proc
        self.lost.discard(node)

    def wait(self, deadline: float) -> tuple[int, bool]:
        """(exit status, timed out): the first failing node's status, else 0."""
        failed = None
        while True:
            if self.doomed is not None:
                failed = LOST
                break
            codes = [p.poll() for i, p in enumerate(self.procs) if i not in self.lost]
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
        procs = self.procs + self.retired
        for proc in procs:
            _signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for proc in procs:
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


def _pump(stream, log: Path, rank0: list[str], times: list[float], echo: TextIO | None) -> None:
    """Copy node 0's console to its log; keep (and echo) rank 0's lines without the prefix."""
    with open(log, "w") as out:
        for line in stream:
            out.write(line)
            out.flush()
            if line.startswith(RANK0_PREFIX):
                line = line[len(RANK0_PREFIX) :]
                times.append(time.monotonic())
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
    elastic: bool = False,
) -> Job:
    """Start one command per node (node 0's console piped and pumped, others to files)."""
    job = Job([], [], elastic=elastic)
    for node, argv in enumerate(commands):
        log = logdir / f"node{node}.log"
        job.logs.append(log)
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
                target=_pump, args=(proc.stdout, log, job.output, job.times, echo), daemon=True
            )
            job.reader.start()
        else:
            proc = start_node(argv, env, log)
        job.procs.append(proc)
    return job


def start_node(argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    """One node's torchrun, its console appended to ``log``, in a session of its own."""
    with open(log, "a") as out:
        return subprocess.Popen(
            argv,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
