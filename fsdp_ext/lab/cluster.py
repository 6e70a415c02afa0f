"""``Cluster``: build an emulated multi-node cluster, run jobs in it, always tear it down."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from fsdp_ext.lab.cleanup import KILL_WAIT_S, clean_stale, remove_run
from fsdp_ext.lab.counters import NodeBytes, read_node_bytes
from fsdp_ext.lab.launcher import RDZV_BACKENDS, node_env, rank_logs, start_job, torchrun_argv
from fsdp_ext.lab.names import RunNames
from fsdp_ext.lab.network import MAX_NODES, Topology, build_network, set_rate
from fsdp_ext.lab.rates import format_rate, parse_rate
from fsdp_ext.lab.requirements import check_requirements
from fsdp_ext.lab.storage import StorageServer, mount_shared, start_sshd

__all__ = ["DEFAULT_TIMEOUT_S", "Cluster", "LabResult"]

DEFAULT_TIMEOUT_S = 900.0


@dataclass(frozen=True)
class LabResult:
    """What one job did: exit status, node 0's console, and each node's bytes on the wire."""

    returncode: int
    output: str  # rank 0's stdout and stderr, as streamed
    link_bytes: list[NodeBytes]  # per node: the change of its interface counters over the job
    seconds: float
    timed_out: bool
    rank_stdout: list[str]  # per global rank (node * ranks_per_node + local rank)
    rank_stderr: list[str]
    consoles: list[str]  # per node: its torchrun's own console (rank 0's lines on node 0)

    def last_json(self) -> dict | None:
        """The last line of the output that parses as a JSON object (benchmarks end so)."""
        for line in reversed(self.output.splitlines()):
            line = line.strip()
            if line.startswith("{"):
                try:
                    return json.loads(line)
                except ValueError:
                    continue
        return None


class Cluster:
    """Nodes as network namespaces with capped links, shared storage, torchrun per node.

    Use it as a context manager; everything it built is removed on leaving the block,
    whatever the exit (exception, Ctrl-C, timeout). Entering also removes what labs whose
    owner process died left behind. ``link`` caps each node's link in both directions;
    ``storage_link`` caps each node's own link to the storage (default: ``link``).
    ``shared_dir`` is served by the storage namespace and mounted at the same path on every
    node (default: a directory of the run, removed with it); from the host it is the disk.
    """

    def __init__(
        self,
        nodes: int = 2,
        ranks_per_node: int = 1,
        link: str | int = "200mbit",
        *,
        storage_link: str | int | None = None,
        shared_dir: str | os.PathLike | None = None,
        storage: bool = True,
        rdzv: str = "c10d",
        timeout: float = DEFAULT_TIMEOUT_S,
        python: str = sys.executable,
    ):
        if isinstance(nodes, bool) or not isinstance(nodes, int) or not 1 <= nodes <= MAX_NODES:
            raise ValueError(f"nodes must be an int from 1 to {MAX_NODES}, got {nodes!r}")
        rpn = ranks_per_node
        if isinstance(rpn, bool) or not isinstance(rpn, int) or rpn < 1:
            raise ValueError(f"ranks_per_node must be an int >= 1, got {rpn!r}")
        if rdzv not in RDZV_BACKENDS:
            raise ValueError(f"rdzv must be one of {', '.join(RDZV_BACKENDS)}, got {rdzv!r}")
        if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or timeout <= 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        if shared_dir is not None and not storage:
            raise ValueError("shared_dir needs storage=True (the shared directory is sshfs)")
        self.nodes = nodes
        self.ranks_per_node = rpn
        self.link_bits = parse_rate(link, name="link")
        self.storage_bits = (
            self.link_bits
            if storage_link is None
            else parse_rate(storage_link, name="storage_link")
        )
        self.storage = storage
        self.rdzv = rdzv
        self.timeout = float(timeout)
        self.python = python
        self.names = RunNames.new()
        self.topology = Topology(self.names, nodes, storage)
        self.shared_dir = (
            self.names.workdir / "shared" if shared_dir is None else Path(shared_dir).resolve()
        )
        self._mounts: list[subprocess.Popen] = []
        self._services: list[subprocess.Popen] = []
        self._extra: list[subprocess.Popen] = []
        self._built = False
        self._closed = False

    # ----------------------------------------------------------------- lifecycle
    def __enter__(self) -> Cluster:
        check_requirements(storage=self.storage, names=self.names)
        clean_stale()
        self.names.write_owner()
        self._built = True
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _build(self) -> None:
        build_network(self.topology, self.link_bits, self.storage_bits)
        if not self.storage:
            return
        self.shared_dir.mkdir(parents=True, exist_ok=True)
        server = StorageServer(self.names.workdir, self.shared_dir)
        logs = self.names.workdir / "logs"
        logs.mkdir(exist_ok=True)
        self._services.append(start_sshd(server, self.topology, logs / "sshd.log"))
        for node in range(self.nodes):
            self._mounts.append(
                mount_shared(server, self.topology, node, logs / f"sshfs{node}.log")
            )

    def close(self) -> None:
        """Stop every process, delete the namespaces, links, mounts and the run's files."""
        if self._closed or not self._built:
            return
        self._closed = True
        remove_run(self.names, self.topology.namespaces)
        for proc in self._extra + self._mounts + self._services:
            try:
                proc.wait(timeout=KILL_WAIT_S)
            except subprocess.TimeoutExpired:  # never entered a namespace of the run
                proc.kill()
                proc.wait()

    # ----------------------------------------------------------------- inside the nodes
    @property
    def run_id(self) -> str:
        return self.names.run_id

    @property
    def namespaces(self) -> list[str]:
        """Every network namespace of this lab (nodes, then switch and storage if any)."""
        return self.topology.namespaces

    def node_address(self, node: int) -> str:
        """Node ``node``'s address on the link (also reachable by the name ``node<N>``)."""
        self._check_node(node)
        return self.topology.node_address(node)

    def node_command(self, node: int, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside node ``node``: its network namespace and its mount namespace."""
        self._check_node(node)
        enter = ["ip", "netns", "exec", self.topology.node_namespaces[node]]
        if self._mounts:
            # nsenter --mount starts in the mount namespace's root unless told the directory
            target = f"--target={self._mounts[node].pid}"
            enter = ["nsenter", target, "--mount", f"--wd={os.getcwd()}", "--", *enter]
        return enter + list(argv)

    def exec(
        self,
        node: int,
        argv: Sequence[str],
        *,
        timeout: float = 60.0,
        env: dict[str, str] | None = None,
        check: bool = True,
    ) -> subprocess.CompletedProcess:
        """Run ``argv`` in node ``node`` to completion; stdout and stderr captured as text."""
        return subprocess.run(
            self.node_command(node, argv),
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
            check=check,
        )

    def popen(self, node: int, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        """Start ``argv`` in node ``node``; it is killed when the lab is torn down."""
        proc = subprocess.Popen(self.node_command(node, argv), **kwargs)
        self._extra.append(proc)
        return proc

    def link_bytes(self) -> list[NodeBytes]:
        """Each node's interface counters now (absolute; subtract two readings)."""
        return read_node_bytes(self.topology)

    def set_link(self, rate: str | int) -> None:
        """Change the cap of every node link (both ends) without rebuilding the lab."""
        bits = parse_rate(rate, name="link")
        for ns, device in self.topology.fabric_ends():
            set_rate(ns, device, bits)
        self.link_bits = bits

    def set_storage_link(self, rate: str | int) -> None:
        """Change the cap of every node's storage link (both ends)."""
        bits = parse_rate(rate, name="storage_link")
        for ns, device in self.topology.storage_ends():
            set_rate(ns, device, bits)
        self.storage_bits = bits

    # ----------------------------------------------------------------- jobs
    def run(
        self,
        program: Sequence[str],
        *,
        env: dict[str, str] | None = None,
        timeout: float | None = None,
        echo: TextIO | None = None,
    ) -> LabResult:
        """Run ``program`` (SCRIPT ARGS...) under torchrun on every node; wait for the job.

        ``echo`` receives node 0's console as it comes (e.g. ``sys.stdout``), rank 0's
        lines without torchrun's prefix. ``env`` replaces this process's environment for
        the job. The job is stopped at ``timeout`` seconds (default: the lab's), and then
        ``timed_out`` is set.
        """
        if not self._built or self._closed:
            raise RuntimeError("Cluster.run needs an open lab: use it inside `with Cluster(...)`")
        program = list(program)
        if not program:
            raise ValueError("program must name a script (SCRIPT ARGS...), got an empty list")
        limit = self.timeout if timeout is None else float(timeout)
        base = dict(os.environ if env is None else env)
        job_env = node_env(base, self.topology, self.ranks_per_node)
        logdir = self.names.workdir / "logs" / f"job{time.monotonic_ns()}"
        logdir.mkdir(parents=True)
        commands = [
            self.node_command(
                node,
                torchrun_argv(
                    self.topology,
                    node,
                    self.ranks_per_node,
                    program,
                    rdzv=self.rdzv,
                    python=self.python,
                    log_dir=logdir / f"node{node}",
                ),
            )
            for node in range(self.nodes)
        ]
        before = self.link_bytes()
        start = time.monotonic()
        job = start_job(commands, job_env, logdir, echo=echo)
        try:
            returncode, timed_out = job.wait(start + limit)
        except BaseException:
            job.stop()
            raise
        seconds = time.monotonic() - start
        after = self.link_bytes()
        logs = [
            rank_logs(logdir / f"node{node}", local)
            for node in range(self.nodes)
            for local in range(self.ranks_per_node)
        ]
        return LabResult(
            returncode=returncode,
            output="".join(job.output),
            link_bytes=[a - b for a, b in zip(after, before, strict=True)],
            seconds=seconds,
            timed_out=timed_out,
            rank_stdout=[out for out, _ in logs],
            rank_stderr=[err for _, err in logs],
            consoles=[log.read_text(errors="replace") for log in job.logs],
        )

    def describe(self) -> str:
        """One line: the shape of the lab."""
        storage = (
            f", storage {format_rate(self.storage_bits)} per node at {self.shared_dir}"
            if self.storage
            else ""
        )
        return (
            f"{self.nodes} nodes x {self.ranks_per_node} ranks, links "
            f"{format_rate(self.link_bits)} each way{storage} ({self.run_id})"
        )

    def _check_node(self, node: int) -> None:
        if isinstance(node, bool) or not isinstance(node, int) or not 0 <= node < self.nodes:
            raise ValueError(f"node must be an int from 0 to {self.nodes - 1}, got {node!r}")
