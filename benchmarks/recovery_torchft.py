"""Running the torchft peer of benchmarks/recovery.py in the same lab, and striking it alike.

torchft is not a torchrun-elastic job: each node is a replica group of its own (one
``torchrun --nnodes 1`` per node, benchmarks/torchft_train.py), and torchft's lighthouse (its
Rust binary, ``torchft_lighthouse``) runs on node 0 with ``--min_replicas 1``. Node 1 is lost
the same way as in our job: every process of its namespace gets SIGKILL when rank 0 prints
the fault's step. torchft comes from the package index (``pip install torchft==0.2.0``); where
it is not importable, ``torchft_missing`` says what is missing, in one line.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from fsdp_ext.lab import FABRIC_DEVICE, Cluster, kill_namespace

__all__ = ["LIGHTHOUSE_PORT", "TorchftRun", "run_torchft", "torchft_missing"]

REPO = Path(__file__).resolve().parent.parent
LIGHTHOUSE_PORT = 29510
STORE_PORT = 29400
LIGHTHOUSE = (
    "import sys\nfrom torchft._torchft import lighthouse_main\nsys.argv[0] = 'torchft_lighthouse'\n"
    "sys.exit(lighthouse_main())\n"
)


def torchft_missing(python: str = sys.executable, env: dict | None = None) -> str | None:
    """None where ``python`` imports torchft's Manager and its Rust extension; else the
    error, as that interpreter printed it (the last line)."""
    probe = "import torchft, torchft._torchft; from torchft import Manager, ProcessGroupGloo"
    out = subprocess.run([python, "-c", probe], capture_output=True, text=True, env=env)
    if out.returncode == 0:
        return None
    lines = (out.stderr or out.stdout).strip().splitlines()
    return lines[-1] if lines else f"exit status {out.returncode}"


@dataclass
class TorchftRun:
    """Rank 0's lines of each replica group (with when they came), and how it ended."""

    lines: list[list[tuple[float, str]]] = field(default_factory=lambda: [[], []])
    returncodes: list[int | None] = field(default_factory=list)
    started_at: float = 0.0
    seconds: float = 0.0
    struck_at: float | None = None
    timed_out: bool = False
    lighthouse_log: str = ""


def _ignore(_line: str) -> None:
    pass


def _pump(stream, out: list, on_line) -> None:
    for line in stream:
        out.append((time.time(), line))
        on_line(line)


def run_torchft(
    lab: Cluster,
    train_flags: list[str],
    *,
    name: str,
    kill_node_at: str | None,
    env: dict[str, str],
    timeout: float,
) -> TorchftRun:
    """One torchft job over the lab's nodes; node 1 is killed from outside when node 0's
    rank 0 first prints ``kill_node_at`` (None: no fault)."""
    ready = lab.shared_dir / f"{name}-ready"
    job_env = {**env, "GLOO_SOCKET_IFNAME": FABRIC_DEVICE, "PYTHONUNBUFFERED": "1"}
    cores = os.cpu_count() or 1
    job_env.setdefault("OMP_NUM_THREADS", str(max(1, cores // (lab.nodes * lab.ranks_per_node))))
    script = lab.shared_dir / "lighthouse.py"
    script.write_text(LIGHTHOUSE)
    lighthouse_argv = [sys.executable, str(script), "--bind", f"0.0.0.0:{LIGHTHOUSE_PORT}"]
    lighthouse_argv += ["--min_replicas", "1"]
    log = lab.shared_dir / f"{name}-lighthouse.log"
    with open(log, "wb") as sink:
        lighthouse = lab.popen(
            0, lighthouse_argv, env=job_env, stdout=sink, stderr=sink, start_new_session=True
        )
    run = TorchftRun(started_at=time.time())
    procs, readers = [], []
    strike = threading.Event()

    def on_line(line: str) -> None:
        if kill_node_at is not None and run.struck_at is None and kill_node_at in line:
            run.struck_at = time.time()
            strike.set()

    for node in range(lab.nodes):
        addr = lab.node_address(node)
        argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1"]
        argv += ["--nproc-per-node", str(lab.ranks_per_node), "--rdzv-backend", "c10d"]
        argv += ["--rdzv-endpoint", f"{addr}:{STORE_PORT}", "--local-addr", addr]
        argv += ["--local-ranks-filter", "0", "--tee", "3"]
        argv += [str(REPO / "benchmarks" / "torchft_train.py"), "--replica", str(node)]
        argv += ["--replicas", str(lab.nodes), "--node-addr", addr, "--ready-dir", str(ready)]
        argv += ["--lighthouse", f"http://{lab.node_address(0)}:{LIGHTHOUSE_PORT}"]
        argv += ["--", *train_flags]
        proc = lab.popen(
            node,
            argv,
            env=job_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            start_new_session=True,
        )
        reader = threading.Thread(
            target=_pump, args=(proc.stdout, run.lines[node], on_line if node == 0 else _ignore)
        )
        reader.daemon = True
        reader.start()
        procs.append(proc)
        readers.append(reader)
    start = time.monotonic()
    if kill_node_at is not None:
        strike.wait(timeout)
        if strike.is_set():
            kill_namespace(lab.topology.node_namespaces[1])
    try:
        procs[0].wait(timeout=max(1.0, timeout - (time.monotonic() - start)))
    except subprocess.TimeoutExpired:
        run.timed_out = True
    run.seconds = time.time() - run.started_at
    for proc in [*procs, lighthouse]:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    for reader in readers:
        reader.join(timeout=10)
    run.returncodes = [p.returncode for p in procs]
    run.lighthouse_log = log.read_text(errors="replace")[-2000:]
    return run
