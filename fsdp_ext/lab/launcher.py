"""torchrun on every node, as a real multi-node launch: one agent per node, the rendezvous
on node 0's link address (c10d) or in etcd off the training nodes, gloo bound to the link.

Every node's console goes to its log; rank 0's lines are collected from whichever node holds
rank 0. The job ends when every node that is not lost has exited, or as soon as one fails
(the others are stopped, as a cluster scheduler would), or at the deadline.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from fsdp_ext.lab.network import FABRIC_DEVICE, Topology
from fsdp_ext.lab.supervisor import lost_cause

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
RDZV_BACKENDS = ("c10d", "etcd", "static")
STOP_GRACE_S = 10.0
TIMED_OUT = 124  # the exit status of timeout(1)
LOST = 125  # a node was lost that the job could not do without


# every node tees its local rank 0 to its console, each line prefixed with its global rank
# (torchrun's TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE): rank 0 lives on whichever node the
# rendezvous ranked first, and that is not node 0 once node 0 was lost
LINE_PREFIX_TEMPLATE = "[rank${rank}]:"
WORKER_LINE = re.compile(r"^\[rank(\d+)\]:")


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
    job_id: str | None = None,
) -> list[str]:
    """The torchrun command line node ``node`` runs (``program`` is SCRIPT ARGS...).

    ``job_id`` names the rendezvous (default: the lab's run id). Give each job of a lab its
    own: etcd keeps a finished job's rendezvous, closed, and a second job under the same id
    fails at once with RendezvousClosedError.

    Every rank's stdout and stderr go to files under ``log_dir``; every node also copies
    its local rank 0's lines to its console, prefixed with the global rank (``[rank0]:``).
    """
    nnodes = elastic.nnodes(topology.nodes)
    argv = [python, "-m", "torch.distributed.run", "--nnodes", nnodes]
    argv += ["--nproc-per-node", str(ranks_per_node), "--max-restarts", str(elastic.max_restarts)]
    argv += ["--log-dir", str(log_dir), "--redirects", "3", "--tee", "3"]
    argv += ["--local-ranks-filter", "0"]
    master = topology.node_address(0)
    # a fixed-size job keeps torchrun's defaults (fewer keep-alives on the measured link)
    conf = RDZV_CONF if elastic.on else ""
    rdzv_id = job_id or topology.names.run_id
    if rdzv == "etcd":
        # the rendezvous lives in etcd on the lab's infrastructure namespace, which runs no
        # training: any node may be lost, node 0 included
        argv += ["--rdzv-backend", "etcd-v2", "--rdzv-endpoint", topology.rendezvous_endpoint]
        argv += ["--rdzv-id", rdzv_id] + (["--rdzv-conf", conf] if conf else [])
        argv += ["--local-addr", topology.node_address(node)]
    elif topology.nodes == 1:
        argv += ["--standalone"]
    elif rdzv == "c10d":
        # is_host: node 0 serves the rendezvous store (torchrun cannot tell by hostname here);
        # --local-addr orders the nodes, so node k gets GROUP_RANK k
        argv += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"{master}:{RDZV_PORT}"]
        conf = f"is_host={int(node == 0)}" + (f",{conf}" if conf else "")
        argv += ["--rdzv-id", rdzv_id, "--rdzv-conf", conf]
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
    env["TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"] = LINE_PREFIX_TEMPLATE
    env.setdefault("PYTHONUNBUFFERED", "1")
    # the nodes share this machine's cores; each rank gets its share, not all of them
    cores = os.cpu_count() or 1
    env.setdefault("OMP_NUM_THREADS", str(max(1, cores // (topology.nodes * ranks_per_node))))
    return env


@dataclass
class Job:
    """The torchrun processes of one run (one per node), and rank 0's lines from whichever
    node holds rank 0. Each poll of ``wait`` looks for lost nodes (``supervisor.lost_cause``)
    and hands each to ``on_lost``, the lab's scheduler, which decides (``doomed``), cleans up
    and may ``replace`` it; without one, a lost node ends the job. Any other torchrun that
    fails ends the job."""

    procs: list[subprocess.Popen]
    logs: list[Path]
    output: list[str] = field(default_factory=list)
    times: list[float] = field(default_factory=list)  # when each output line came (monotonic)
    readers: list[threading.Thread] = field(default_factory=list)
    elastic: bool = False
    lost: set[int] = field(default_factory=set)  # nodes down now (lost, not yet replaced)
    retired: list[subprocess.Popen] = field(default_factory=list)  # torchruns of lost nodes
    doomed: str | None = None  # why the job cannot go on (set by the lab), or None
    failure: str | None = None  # which torchrun failed on its own, and how
    on_lost: Callable[[int, str], None] | None = None  # (node, cause): the lab's scheduler
    node_up: Callable[[int], bool] = lambda node: True  # whether the node's namespace is there
    echo: TextIO | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def replace(self, node: int, proc: subprocess.Popen) -> None:
        """A fresh torchrun on node ``node`` in place of the lost one; from now on its
        failures are the job's, as any other node's."""
        self.retired.append(self.procs[node])
        self.procs[node] = proc
        self.lost.discard(node)

    def watch(self) -> None:
        """Hand every node lost since the last look to ``on_lost`` (once each)."""
        for node, proc in enumerate(self.procs):
            if node in self.lost:
                continue
            cause = lost_cause(proc.poll(), self.node_up(node))
            if cause is None:
                continue
            self.lost.add(node)
            if self.on_lost is None:
                self.doomed = f"node {node} was lost ({cause})"
            else:
                self.on_lost(node, cause)

    def wait(self, deadline: float) -> tuple[int, bool]:
        """(exit status, timed out): the first failing node's status, else 0."""
        failed = None
        while True:
            self.watch()
            if self.doomed is not None:
                failed = LOST
                break
            codes = {i: p.poll() for i, p in enumerate(self.procs) if i not in self.lost}
            # a status below 0 (killed by a signal) is a loss, seen by the next watch: the
            # node may have died between the watch above and this poll
            bad = next(((i, c) for i, c in codes.items() if c is not None and c > 0), None)
            if bad is not None:
                node, failed = bad
                self.failure = f"node {node}'s torchrun failed with exit status {failed}"
                break
            if all(c == 0 for c in codes.values()):
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
        for reader in self.readers:
            reader.join(timeout=STOP_GRACE_S)


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)


def _pump(stream, log: Path, job: Job, node: int) -> None:
    """Copy a node's console to its log; keep (and echo) rank 0's lines without the prefix,
    and echo node 0's own torchrun lines as they come."""
    with open(log, "a") as out:
        for line in stream:
            out.write(line)
            out.flush()
            worker = WORKER_LINE.match(line)
            if worker is not None and worker.group(1) == "0":
                line = line[worker.end() :]
                with job.lock:
                    job.times.append(time.monotonic())
                    job.output.append(line)
            elif worker is not None or node != 0:
                continue
            if job.echo is not None:
                job.echo.write(line)
                job.echo.flush()


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
    """Start one command per node, each console pumped into its log (see ``_pump``)."""
    job = Job([], [], elastic=elastic, echo=echo)
    for node, argv in enumerate(commands):
        job.logs.append(logdir / f"node{node}.log")
        job.procs.append(start_node(argv, env, job, node))
    return job


def start_node(argv: list[str], env: dict[str, str], job: Job, node: int) -> subprocess.Popen:
    """One node's torchrun in a session of its own (Ctrl-C reaches the lab, which stops the
    job in order), its console appended to the node's log by a reader thread."""
    proc = subprocess.Popen(
        argv,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        errors="replace",
        start_new_session=True,
    )
    reader = threading.Thread(
        target=_pump, args=(proc.stdout, job.logs[node], job, node), daemon=True
    )
    reader.start()
    job.readers.append(reader)
    return proc
