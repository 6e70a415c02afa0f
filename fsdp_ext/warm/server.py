"""The warm worker server (a zygote): one per node, started before the launcher.

    python fsdp_ext/warm/server.py --socket PATH [--preload MODULE ...]

It listens on ``PATH`` at once, then imports torch, torch.distributed, DCP, FSDP2, fsdp_ext
and the ``--preload`` modules (the 4-37 s every fresh worker pays, see docs/recovery.md),
once. Clients that connect meanwhile wait in the backlog. It runs no torch op and starts
no thread of its own, so a fork of it is a clean worker: each client (client.py) gets a
child that becomes the client's program (worker.py) while this process reaps it and
reports its exit status back over the client's connection.

SIGTERM or SIGINT: stop taking clients (the socket is removed), wait for the running
workers, exit 0.

Run by path, like the client: it execs itself once at start with a padded environment
(``ROOM_ENV``), so that each worker can show its own client's environment in
/proc/PID/environ (see worker.py).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import importlib.util
import os
import select
import signal
import socket
import sys
import time

from wire import MAX_FDS, receive, send
from worker import Request, become

__all__ = ["BASE_MODULES", "ROOM_BYTES", "ROOM_ENV", "main"]

ROOM_ENV = "FSDP_EXT_WARM_ROOM"
ROOM_BYTES = 64 * 1024
BASE_MODULES = (
    "torch",
    "torch.distributed",
    "torch.distributed.checkpoint",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "torch.distributed.run",
    "fsdp_ext",
)
POLL_S = 0.05
REQUEST_TIMEOUT_S = 10.0  # a client that connects and says nothing is dropped


def _make_room() -> None:
    """Exec this script again with ``ROOM_BYTES`` of padding in its environment (once,
    before any import): a worker overwrites that block with its client's environment."""
    if os.environ.pop(ROOM_ENV, None) is not None:
        return
    env = dict(os.environ, **{ROOM_ENV: "x" * ROOM_BYTES})
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


def _listen(path: str) -> socket.socket:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)  # a dead server's socket
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    os.chmod(path, 0o600)  # the node's user only: a client hands over its environment
    listener.listen(128)
    return listener


def _preload(modules: list[str]) -> float:
    """Import everything once; then freeze what was imported out of the collector's sight
    (``gc.freeze``): a worker's collections would otherwise write to every object the
    server made, and copy on write each of their pages into the worker."""
    start = time.monotonic()
    for name in (*BASE_MODULES, *modules):
        importlib.import_module(name)
    gc.collect()
    gc.freeze()
    return time.monotonic() - start


class _Stop:
    """SIGTERM/SIGINT: take no more clients (checked by the loop, never raised)."""

    def __init__(self) -> None:
        self.asked = False
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._ask)

    def _ask(self, _sig, _frame) -> None:
        self.asked = True


def _reap(workers: dict[int, socket.socket]) -> None:
    """Report each ended worker's wait status to its client, and forget it."""
    while workers:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = workers.pop(pid, None)
        if conn is not None:
            with contextlib.suppress(OSError):
                send(conn, {"status": status})
            conn.close()


def _start(conn: socket.socket, workers: dict[int, socket.socket]) -> Request | None:
    """Fork a worker for the client on ``conn``; in the worker, its request."""
    conn.settimeout(REQUEST_TIMEOUT_S)
    try:
        message, fds = receive(conn)
    except (OSError, ValueError):
        conn.close()
        return None
    conn.settimeout(None)
    if message is None or len(fds) not in (3, MAX_FDS):
        for fd in fds:
            os.close(fd)
        with contextlib.suppress(OSError):
            send(conn, {"error": f"a request needs argv, env, cwd and 3 or {MAX_FDS} descriptors"})
        conn.close()
        return None
    pid = os.fork()
    if pid == 0:
        return Request.from_message(message, fds, conn, list(workers.values()))
    for fd in fds:
        os.close(fd)
    workers[pid] = conn
    with contextlib.suppress(OSError):  # a client gone: its worker's watchdog ends it
        send(conn, {"pid": pid})
    return None


def serve(listener: socket.socket, path: str) -> Request | None:
    """Fork a worker per client until asked to stop; returns a request only in a worker
    (None in the server, once it stopped and every worker ended)."""
    stop = _Stop()
    workers: dict[int, socket.socket] = {}
    while not stop.asked:
        _reap(workers)
        ready, _, _ = select.select([listener], [], [], POLL_S)
        if not ready:
            continue
        with contextlib.suppress(BlockingIOError, InterruptedError):
            conn, _ = listener.accept()
            request = _start(conn, workers)
            if request is not None:
                listener.close()
                return request
    listener.close()
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    while workers:
        _reap(workers)
        time.sleep(POLL_S)
    return None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="server.py", description=__doc__.split("\n")[0])
    parser.add_argument("--socket", required=True, help="the Unix socket's path")
    parser.add_argument(
        "--preload",
        action="append",
        default=[],
        metavar="MODULE",
        help="a module to import before forking (repeatable)",
    )
    args = parser.parse_args(argv)
    # a module name resolves as under ``python -m MODULE``: the working directory, then
    # PYTHONPATH (after this file's folder, for wire and worker)
    sys.path.insert(1, os.getcwd())
    # checked before listening: the lab then sees the server gone, not workers falling back
    # to fresh interpreters
    for module in args.preload:
        package = module.partition(".")[0]
        if importlib.util.find_spec(package) is not None:
            continue
        parser.error(
            f"--preload {module}: no module {package!r} from the "
            f"working directory {os.getcwd()} or PYTHONPATH; start the server where "
            "`python -m` would find it, or put its folder on PYTHONPATH"
        )
    _make_room()
    listener = _listen(args.socket)
    seconds = _preload(args.preload)
    print(
        f"warm: ready at {args.socket} (pid {os.getpid()}): imported in {seconds:.2f} s", flush=True
    )
    request = serve(listener, args.socket)
    if request is not None:
        become(request)


if __name__ == "__main__":
    main()
