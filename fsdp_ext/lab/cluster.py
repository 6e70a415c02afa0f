"""``Cluster``: build an emulated multi-node cluster, run jobs in it, always tear it down."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from fsdp_ext.lab.cleanup import (
    JOB_MARK,
    KILL_WAIT_S,
    clean_stale,
    kill_marked,
    namespace_inode,
    netns_pids,
    remove_run,
)
from fsdp_ext.lab.counters import NodeBytes, read_node_bytes
from fsdp_ext.lab.faults import (
    Fault,
    FaultEvent,
    FaultInjector,
    kill_namespace,
    kill_process,
    link_down,
    rank_pids,
)
from fsdp_ext.lab.launcher import (
    RDZV_BACKENDS,
    Elastic,
    Job,
    node_env,
    rank_logs,
    start_job,
    start_node,
    torchrun_argv,
)
from fsdp_ext.lab.names import RunNames
from fsdp_ext.lab.network import MAX_NODES, Topology, build_network, rebuild_node, set_rate
from fsdp_ext.lab.rates import format_rate, parse_rate
from fsdp_ext.lab.rendezvous import start_etcd
from fsdp_ext.lab.requirements import check_requirements, storage_service
from fsdp_ext.lab.s3 import S3_BUCKET, lab_s3_env, start_s3
from fsdp_ext.lab.storage import StorageServer, mount_node_ram, mount_shared, start_sshd
from fsdp_ext.lab.supervisor import LossPolicy, NodeLoss, namespace_exists
from fsdp_ext.lab.warm import WarmServers

__all__ = ["DEFAULT_TIMEOUT_S", "Cluster", "LabResult"]

DEFAULT_TIMEOUT_S = 900.0
QUIET_WAIT_S = 10.0  # a loaded machine takes up to a second per reading of all nodes


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
    faults: list[FaultEvent] = field(default_factory=list)  # what the lab struck, and when
    line_times: list[float] = field(default_factory=list)  # per line of output: seconds in
    problems: list[str] = field(default_factory=list)  # what went wrong around the job
    started_at: float = 0.0  # the job's start, seconds since the epoch (for torchrun's logs)
    losses: list[NodeLoss] = field(default_factory=list)  # nodes found lost, and what followed

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
    ``storage``: True or "sshfs" (that shared directory), "s3" (an S3 server, SeaweedFS, in
    the storage namespace, at ``storage_location`` = ``s3://lab`` with the endpoint and
    credentials in every job's environment; see ``fsdp_ext/lab/s3.py``), or False (none).
    ``warm_workers``: every node runs a warm worker server (``fsdp_ext.warm``) that imports
    torch, fsdp_ext and ``warm_preload`` once, and every job's workers are forked from it
    instead of starting fresh interpreters (a restart then skips the imports). With
    ``warm_spare`` a further warm server, outside the training nodes, stands for a
    pre-booted spare machine: a fresh node that replaces a lost one has its torchrun agent
    and its workers forked from it (see ``fsdp_ext/lab/warm.py``).
    ``storage_nice`` (0 to 19) is the nice value of the storage node's servers (sshd or
    weed). The lab's nodes share this machine's cores; a real storage server is a machine
    of its own. At 19 the servers run on what the ranks leave idle, instead of taking it
    from them: a benchmark of training beside a save sets it (weed used 0.67 of a core
    while a 200 Mbit/s save was written, docs/checkpoint.md). The default, 0, shares the
    cores evenly, so a busy machine cannot starve the servers of a test.
    """

    def __init__(
        self,
        nodes: int = 2,
        ranks_per_node: int = 1,
        link: str | int = "200mbit",
        *,
        storage_link: str | int | None = None,
        shared_dir: str | os.PathLike | None = None,
        storage: bool | str = True,
        rdzv: str = "c10d",
        timeout: float = DEFAULT_TIMEOUT_S,
        python: str = sys.executable,
        warm_workers: bool = False,
        warm_preload: Sequence[str] = (),
        warm_spare: bool = False,
        storage_nice: int = 0,
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
        if not isinstance(warm_workers, bool):
            raise ValueError(f"warm_workers must be True or False, got {warm_workers!r}")
        if isinstance(warm_preload, str) or not all(isinstance(m, str) and m for m in warm_preload):
            raise ValueError(
                f"warm_preload must be a sequence of module names, got {warm_preload!r}"
            )
        if warm_preload and not warm_workers:
            raise ValueError("warm_preload needs warm_workers=True")
        if not isinstance(warm_spare, bool):
            raise ValueError(f"warm_spare must be True or False, got {warm_spare!r}")
        if warm_spare and not (warm_workers and storage):
            raise ValueError(
                "warm_spare needs warm_workers=True and storage (the spare runs in the "
                "storage namespace)"
            )
        if isinstance(storage_nice, bool) or storage_nice not in range(20):
            raise ValueError(f"storage_nice must be an int from 0 to 19, got {storage_nice!r}")
        service = storage_service(storage)
        if shared_dir is not None and service != "sshfs":
            raise ValueError(
                f"shared_dir needs storage=True or 'sshfs' (the shared directory is sshfs), "
                f"got storage={storage!r}"
            )
        self.nodes = nodes
        self.ranks_per_node = rpn
        self.link_bits = parse_rate(link, name="link")
        self.storage_bits = (
            self.link_bits
            if storage_link is None
            else parse_rate(storage_link, name="storage_link")
        )
        self.storage = service is not None
        self.storage_service = service  # "sshfs", "s3" or None
        self.storage_nice = storage_nice
        self.rdzv = rdzv
        self.timeout = float(timeout)
        self.python = python
        self.names = RunNames.new()
        self.topology = Topology(self.names, nodes, self.storage, infra=rdzv == "etcd")
        self.shared_dir = (
            self.names.workdir / "shared" if shared_dir is None else Path(shared_dir).resolve()
        )
        self._mounts: list[subprocess.Popen] = []
        self._server: StorageServer | None = None
        self._services: list[subprocess.Popen] = []
        self._extra: list[subprocess.Popen] = []
        self._retired: list[subprocess.Popen] = []  # dead sshfs replaced by a fresh mount
        self._inodes: list[int | None] = []  # each node's namespace, found even once unnamed
        self._spare = warm_spare
        self._warm = (
            WarmServers(self.names.workdir, python, tuple(warm_preload)) if warm_workers else None
        )
        self._built = False
        self._closed = False

    # ----------------------------------------------------------------- lifecycle
    def __enter__(self) -> Cluster:
        check_requirements(
            storage=self.storage_service or False,
            names=self.names,
            rdzv=self.rdzv,
            python=self.python,
        )
        clean_stale()
        self.names.write_owner()
        self._built = True
        try:
            self._build()
            for node in range(self.nodes):
                self._start_warm(node)
            if self._spare:
                self._start_spare()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _build(self) -> None:
        build_network(self.topology, self.link_bits, self.storage_bits)
        self._inodes = [namespace_inode(ns) for ns in self.topology.node_namespaces]
        logs = self.names.workdir / "logs"
        logs.mkdir(exist_ok=True)
        if self.topology.infra:
            self._services.append(start_etcd(self.topology, self.names.workdir, logs / "etcd.log"))
        if not self.storage:
            return
        if self.storage_service == "s3":
            log = logs / "s3.log"
            self._services.append(
                start_s3(self.topology, self.names.workdir, log, self.python, self.storage_nice)
            )
            return
        self.shared_dir.mkdir(parents=True, exist_ok=True)
        self._server = StorageServer(self.names.workdir, self.shared_dir)
        self._services.append(
            start_sshd(self._server, self.topology, logs / "sshd.log", self.storage_nice)
        )
        for node in range(self.nodes):
            self._mounts.append(self._mount(node))

    def _mount(self, node: int) -> subprocess.Popen:
        """The node's mount namespace: the shared directory, and a RAM of its own."""
        log = self.names.workdir / "logs" / f"sshfs{node}.log"
        proc = mount_shared(self._server, self.topology, node, log)
        mount_node_ram(proc.pid)
        return proc

    def _start_spare(self) -> None:
        """The spare's warm server, in the storage namespace (no training node)."""
        env = node_env(dict(os.environ), self.topology, self.ranks_per_node)
        inside = ["ip", "netns", "exec", self.topology.names.storage]
        self._warm.ensure("spare", lambda argv: [*inside, *argv], env)

    def _start_warm(self, node: int, *, again: bool = False, now: bool = True) -> None:
        """Node ``node``'s warm server, if the lab has them: started unless it runs, or
        (``again``) in place of the running one, which sits in the node's old mounts; not
        ``now``: only the old one stopped (the next job starts it)."""
        if self._warm is None:
            return
        old = self._warm.procs.get(node)
        if again and old is not None:
            kill_process(old)
        if not now:
            return
        env = node_env(dict(os.environ), self.topology, self.ranks_per_node)
        self._warm.ensure(node, lambda argv: self.node_command(node, argv), env)

    def _remount_lost_storage(self) -> list[str]:
        """A node whose namespace is gone is built again, and a node whose sshfs died (the
        mount answers ENOTCONN) gets a fresh mount; the lines say which, so a job is never
        started on a node that is not whole."""
        notes = []
        for node, ns in enumerate(self.topology.node_namespaces):
            if not namespace_exists(ns):
                self._rebuild(node)
                notes.append(f"node {node}'s namespace {ns} was gone; built it again")
        for node, proc in enumerate(self._mounts):
            if proc.poll() is not None:
                self._retired.append(proc)
                self._mounts[node] = self._mount(node)
                self._start_warm(node, again=True)
                notes.append(
                    f"node {node}'s sshfs had exited (status {proc.returncode}); remounted "
                    f"{self.shared_dir} there"
                )
        for node in range(self.nodes):
            self._start_warm(node)
        return notes

    def _rebuild(self, node: int) -> None:
        """Node ``node``'s namespace and links afresh (after every process of it is gone)."""
        rebuild_node(self.topology, node, self.link_bits, self.storage_bits)
        self._inodes[node] = namespace_inode(self.topology.node_namespaces[node])

    def _clear_node(self, node: int) -> int:
        """SIGKILL whatever is left of node ``node`` (its namespace found by inode, named or
        not), as a scheduler drains a lost machine; how many processes were killed."""
        inode = self._inodes[node]
        killed: set[int] = set()
        deadline = time.monotonic() + KILL_WAIT_S
        while inode is not None and time.monotonic() < deadline:
            pids = netns_pids(inode)
            if not pids:
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            killed.update(pids)
            time.sleep(0.02)
        return len(killed)

    def _fresh_node(self, node: int) -> None:
        """What a replacement needs: its namespace (built again if it was torn down) and,
        with storage, a new mount of the shared directory and its own RAM."""
        if not namespace_exists(self.topology.node_namespaces[node]):
            self._rebuild(node)
        if self._mounts:
            self._retired.append(self._mounts[node])
            self._mounts[node] = self._mount(node)
        # with a spare, the fresh node's job is forked from it: its own server's imports
        # would only compete with that job for the CPU, so it starts with the next job
        self._start_warm(node, again=True, now=not self._spare)

    def close(self) -> None:
        """Stop every process, delete the namespaces, links, mounts and the run's files."""
        if self._closed or not self._built:
            return
        self._closed = True
        remove_run(self.names, self.topology.namespaces)
        warm = self._warm.all() if self._warm is not None else []
        for proc in self._extra + self._mounts + self._retired + self._services + warm:
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
    def storage_location(self) -> str | None:
        """Where jobs keep what every node shares: the shared directory (sshfs), the bucket
        ``s3://lab`` (S3), or None without storage."""
        if self.storage_service == "s3":
            return f"s3://{S3_BUCKET}"
        return str(self.shared_dir) if self.storage else None

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

    def quiet_link_bytes(self) -> list[NodeBytes]:
        """Every node's counters at a moment no frame is on its way: the nodes are read one
        after the other, so a frame sent between two reads would count as sent on one end
        and not yet received on the other. Read until two readings agree (10 s at most:
        the links are silent between jobs, so the first two readings agree)."""
        reading = self.link_bytes()
        deadline = time.monotonic() + QUIET_WAIT_S
        while time.monotonic() < deadline:
            time.sleep(0.05)
            again = self.link_bytes()
            if again == reading:
                break
            reading = again
        return reading

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
        max_restarts: int = 0,
        min_nodes: int | None = None,
        faults: Sequence[Fault] = (),
        replace_failed: bool = False,
    ) -> LabResult:
        """Run ``program`` (SCRIPT ARGS...) under torchrun on every node; wait for the job.

        ``echo`` receives node 0's console as it comes (e.g. ``sys.stdout``), rank 0's
        lines without torchrun's prefix. ``env`` replaces this process's environment for
        the job. The job is stopped at ``timeout`` seconds (default: the lab's), and then
        ``timed_out`` is set.

        Elastic jobs: torchrun restarts the workers up to ``max_restarts`` times, and
        with ``min_nodes`` < nodes a lost node leads to a new rendezvous among the
        survivors. ``faults`` are struck from outside while the job runs; with
        ``replace_failed`` a node lost to ``kill-node`` is started afresh (a new mount, a
        new torchrun), as a scheduler would, and joins the job again.
        """
        if not self._built or self._closed:
            raise RuntimeError("Cluster.run needs an open lab: use it inside `with Cluster(...)`")
        program = list(program)
        if not program:
            raise ValueError("program must name a script (SCRIPT ARGS...), got an empty list")
        faults = list(faults)
        elastic = self.check_run(max_restarts, min_nodes, faults, replace_failed)
        limit = self.timeout if timeout is None else float(timeout)
        problems = self._remount_lost_storage()
        base = dict(os.environ if env is None else env)
        job_env = node_env(base, self.topology, self.ranks_per_node)
        if self.storage_service == "s3":
            job_env = lab_s3_env(job_env)
        logdir = self.names.workdir / "logs" / f"job{time.monotonic_ns()}"
        job_env[JOB_MARK] = logdir.name
        logdir.mkdir(parents=True)
        argvs = [
            torchrun_argv(
                self.topology,
                node,
                self.ranks_per_node,
                program if self._warm is None else self._warm.program(node, program),
                rdzv=self.rdzv,
                python=self.python,
                log_dir=logdir / f"node{node}",
                elastic=elastic,
                job_id=f"{self.run_id}-{logdir.name}",
            )
            for node in range(self.nodes)
        ]
        commands = [self.node_command(node, argv) for node, argv in enumerate(argvs)]
        before = self.quiet_link_bytes()
        start, started_at = time.monotonic(), time.time()
        job = start_job(commands, job_env, logdir, echo=echo, elastic=elastic.on)
        policy = LossPolicy(self.nodes, max_restarts, min_nodes, replace_failed, self.rdzv)
        losses: list[NodeLoss] = []
        namespaces = self.topology.node_namespaces
        job.node_up = lambda node: namespace_exists(namespaces[node])

        def on_lost(node: int, cause: str) -> None:
            losses.append(self._node_lost(job, node, cause, policy, argvs[node], job_env, start))

        job.on_lost = on_lost

        def strike(fault: Fault) -> str:
            return self._strike(fault)

        injector = FaultInjector(faults, job.output, start, strike)
        injector.begin()
        try:
            returncode, timed_out = job.wait(start + limit)
        except BaseException:
            job.stop()
            raise
        finally:
            injector.end()
            left = kill_marked(self.topology.node_namespaces, logdir.name)
        seconds = time.monotonic() - start
        after = self.quiet_link_bytes()
        logs = [
            rank_logs(logdir / f"node{node}", local)
            for node in range(self.nodes)
            for local in range(self.ranks_per_node)
        ]
        problems += injector.errors + [why for why in (job.doomed, job.failure) if why]
        if left:
            problems.append(f"processes of the job outlived its torchruns, killed: {left}")
        return LabResult(
            returncode=returncode,
            output="".join(job.output),
            link_bytes=[a - b for a, b in zip(after, before, strict=True)],
            seconds=seconds,
            started_at=started_at,
            timed_out=timed_out,
            rank_stdout=[out for out, _ in logs],
            rank_stderr=[err for _, err in logs],
            consoles=[log.read_text(errors="replace") for log in job.logs],
            faults=injector.events,
            line_times=[t - start for t in job.times],
            problems=problems,
            losses=losses,
        )

    def check_run(
        self,
        max_restarts: int = 0,
        min_nodes: int | None = None,
        faults: Sequence[Fault] = (),
        replace_failed: bool = False,
    ) -> Elastic:
        """Check :meth:`run`'s elastic options and faults (ValueError naming the argument)."""
        for fault in faults:
            self._check_fault(fault)
        if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
            raise ValueError(f"max_restarts must be an int >= 0, got {max_restarts!r}")
        if min_nodes is not None and (
            isinstance(min_nodes, bool)
            or not isinstance(min_nodes, int)
            or not 1 <= min_nodes <= self.nodes
        ):
            raise ValueError(f"min_nodes must be an int from 1 to {self.nodes}, got {min_nodes!r}")
        if (min_nodes is not None or replace_failed) and max_restarts == 0:
            what = "min_nodes" if min_nodes is not None else "replace_failed"
            raise ValueError(f"{what} needs max_restarts >= 1 (a lost node restarts the workers)")
        if min_nodes is not None and self.rdzv == "static" and self.nodes > 1:
            raise ValueError(
                "min_nodes needs rdzv='c10d' or 'etcd' (the static rendezvous is fixed-size)"
            )
        return Elastic(max_restarts, min_nodes)

    def _check_fault(self, fault: Fault) -> None:
        if not isinstance(fault, Fault):
            raise ValueError(f"faults must be lab.Fault objects, got {fault!r}")
        if fault.kind == "kill-rank":
            world = self.nodes * self.ranks_per_node
            if fault.target >= world:
                raise ValueError(
                    f"kill-rank: rank must be from 0 to {world - 1}, got {fault.target}"
                )
            return
        if fault.target >= self.nodes:
            raise ValueError(
                f"{fault.kind}: node must be from 0 to {self.nodes - 1}, got {fault.target}"
            )
        if fault.kind == "storage-down" and self.storage_service != "sshfs":
            raise ValueError(
                "storage-down needs sshfs storage (storage=True or 'sshfs': it kills a node's "
                f"sshfs), got storage={self.storage_service or False!r}"
            )
        if fault.kind == "link-down" and self.nodes < 2:
            raise ValueError("link-down needs 2 nodes or more (a single node has no link)")

    def _strike(self, fault: Fault) -> str:
        """Do ``fault`` now; the note says what was done. A node killed here is found lost
        by the supervision of the job (``_node_lost``), as one killed by anything else."""
        namespaces = self.topology.node_namespaces
        if fault.kind == "kill-rank":
            node = fault.target // self.ranks_per_node
            pids = rank_pids(namespaces[node], fault.target)
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            return f"SIGKILL to rank {fault.target}'s processes {pids} on node {node}"
        node = fault.target
        if fault.kind == "link-down":
            link_down(namespaces[node], fault.duration_s)
            return f"node {node}'s link was down for {fault.duration_s:g} s"
        if fault.kind == "storage-down":
            kill_process(self._mounts[node])
            return f"node {node}'s sshfs killed: its {self.shared_dir} answers ENOTCONN"
        killed = kill_namespace(namespaces[node])
        return f"SIGKILL to all {killed} processes of node {node}"

    def _node_lost(
        self,
        job: Job,
        node: int,
        cause: str,
        policy: LossPolicy,
        argv: list[str],
        env: dict[str, str],
        start: float,
    ) -> NodeLoss:
        """Node ``node`` died on its own (``cause``): drain what is left of it, then end the
        job with the one line why (``policy``), or let the survivors go on, or start a fresh
        node in its place (``--replace-failed``), as an elastic scheduler does."""
        at = round(time.monotonic() - start, 3)
        killed = self._clear_node(node)
        why = policy.verdict(node, cause, job.lost)
        if why is None and not namespace_exists(self.topology.node_namespaces[node]):
            # its links died with it, and in a two-node lab the cable took the survivor's
            # eth0 along (a real survivor keeps its NIC): the empty node is built again at
            # once, which gives the survivor its link back
            try:
                self._rebuild(node)
            except Exception as exc:
                why = f"node {node} was lost ({cause}) and its links could not be rebuilt: {exc}"
        if why is not None:
            job.doomed = why
            return NodeLoss(node, cause, at, why)
        drained = f"; {killed} processes left of it killed" if killed else ""
        if not policy.replace_failed:
            left = self.nodes - len(job.lost)
            return NodeLoss(
                node,
                cause,
                at,
                f"node {node} was lost ({cause}){drained}; the job goes on with {left} node(s)",
            )
        try:
            self._fresh_node(node)
            if self._spare:  # a pre-booted spare: its agent and workers forked, not started
                argv = self._warm.spare_agent(argv, node)
            fresh = start_node(self.node_command(node, argv), env, job, node)
        except Exception as exc:  # the job cannot get its node back: say so, end it
            job.doomed = f"node {node} was lost ({cause}) and no fresh node could be started: {exc}"
            return NodeLoss(node, cause, at, job.doomed)
        job.replace(node, fresh)
        replaced = round(time.monotonic() - start, 3)
        note = f"node {node} was lost ({cause}){drained}; a fresh node {node} took its place"
        return NodeLoss(node, cause, at, note, replaced)

    def describe(self) -> str:
        """One line: the shape of the lab."""
        storage = (
            f", storage {format_rate(self.storage_bits)} per node at {self.storage_location}"
            if self.storage
            else ""
        )
        if self.storage_service == "s3":
            storage += " (SeaweedFS; AWS_ENDPOINT_URL on every node)"
        warm = ", warm workers" if self._warm is not None else ""
        warm += " and a warm spare" if self._spare else ""
        return (
            f"{self.nodes} nodes x {self.ranks_per_node} ranks, links "
            f"{format_rate(self.link_bits)} each way{storage}{warm} ({self.run_id})"
        )

    def _check_node(self, node: int) -> None:
        if isinstance(node, bool) or not isinstance(node, int) or not 0 <= node < self.nodes:
            raise ValueError(f"node must be an int from 0 to {self.nodes - 1}, got {node!r}")
