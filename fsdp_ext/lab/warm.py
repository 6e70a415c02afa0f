"""Warm worker servers on the lab's nodes (``fsdp_ext.warm``): one per node, in the node's
namespaces, started with the node and again for a fresh node that takes a lost one's place.

A server is part of its node: a node killed from outside takes it along (it is one of the
namespace's processes), the lab's drain of a lost node kills it with the rest, and the
lab's teardown kills it with everything else. Its workers carry their job's mark and their
rank in /proc/PID/environ (see fsdp_ext/warm/worker.py), so ``kill_marked`` and
``rank_pids`` find them as they find fresh workers.

``spare``: one more server, outside the training nodes (in the storage namespace), stands
for a pre-booted spare machine: a fresh node's torchrun agent and its workers are forked
from it (they join the fresh node's namespaces), so the node that replaces a lost one pays
no imports either; the fresh node's own server starts beside them for later.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from fsdp_ext.warm import CLIENT, client_argv, server_argv

__all__ = ["WarmServers"]

READY_WAIT_S = 10.0  # for the socket to appear (the imports come after it)


@dataclass
class WarmServers:
    """The warm server of every node (by index), its socket under ``workdir/warm``."""

    workdir: Path
    python: str
    preload: tuple[str, ...] = ()
    procs: dict[int, subprocess.Popen] = field(default_factory=dict)
    retired: list[subprocess.Popen] = field(default_factory=list)

    def socket(self, node: int | str) -> str:
        """Node ``node``'s server socket (``"spare"``: the spare's)."""
        name = node if isinstance(node, str) else f"node{node}"
        return str(self.workdir / "warm" / f"{name}.sock")

    def program(self, node: int | str, program: Sequence[str]) -> list[str]:
        """``program`` as node ``node``'s torchrun starts it: through its warm server."""
        return client_argv(self.socket(node), list(program))

    def spare_agent(self, torchrun: list[str], node: int) -> list[str]:
        """A fresh node's torchrun command line (``PYTHON -m torch.distributed.run ARGS``,
        whose program goes through node ``node``'s socket) forked from the spare, as are
        the workers it starts."""
        python, flag, module, *args = torchrun
        if (flag, module) != ("-m", "torch.distributed.run"):
            raise ValueError(
                f"torchrun must be PYTHON -m torch.distributed.run ..., got {torchrun}"
            )
        mine, spare = self.socket(node), self.socket("spare")
        args = [spare if arg == mine else arg for arg in args]
        return [python, str(CLIENT), "--socket", spare, "-m", module, *args]

    def ensure(
        self, node: int | str, command: Callable[[list[str]], list[str]], env: dict[str, str]
    ) -> bool:
        """Start node ``node``'s server unless it runs (``command`` puts an argv inside the
        node); whether one was started."""
        proc = self.procs.get(node)
        if proc is not None and proc.poll() is None:
            return False
        if proc is not None:
            self.retired.append(proc)
        path = Path(self.socket(node))
        path.parent.mkdir(exist_ok=True)
        path.unlink(missing_ok=True)  # a dead server's: wait for the new one's below
        log_path = self.workdir / "logs" / f"warm-{node}.log"
        log = open(log_path, "a")  # noqa: SIM115 (the child's)
        with log:
            proc = subprocess.Popen(
                command(server_argv(self.python, str(path), self.preload)),
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.procs[node] = proc
        deadline = time.monotonic() + READY_WAIT_S
        while not path.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        # a server that died before listening (a preload it cannot find) is an error here:
        # otherwise every worker would fall back, silently, to a fresh interpreter
        if not path.exists() and proc.poll() is not None:
            tail = log_path.read_text(errors="replace").strip().splitlines()[-1:]
            raise RuntimeError(
                f"node {node}'s warm worker server exited with {proc.returncode} before "
                f"listening: {' '.join(tail) or '(no output)'}"
            )
        return True

    def all(self) -> list[subprocess.Popen]:
        """Every server process ever started (to wait for at teardown)."""
        return [*self.procs.values(), *self.retired]
