"""The warm worker client: what torchrun (or any launcher) starts in place of the program.

    python fsdp_ext/warm/client.py --socket PATH SCRIPT ARGS...
    python fsdp_ext/warm/client.py --socket PATH -m MODULE ARGS...

It asks the node's warm server (server.py) to fork a worker that already imported torch,
handing it this process's argv, environment, working directory and stdin/stdout/stderr
(the descriptors themselves), and its network, mount and UTS namespaces (a server outside them,
a pre-booted spare, forks a worker that joins them). It then stands in for that worker:
the launcher's signals are forwarded to it, and this process ends as it ended (its exit
status, or killed by the same signal, so torchrun sees -9 for a killed rank). If this
process dies (SIGKILL from the launcher), the worker kills itself (its watchdog sees the
connection close). And this process dies with its launcher (PR_SET_PDEATHSIG): the
worker is the server's child, so a worker watching its parent
(``fsdp_ext.job.exit_with_launcher``) would watch the server; a launcher killed alone
(torchrun's agent) still takes its workers along, through here.

Without a server (no socket, nobody listening), the program starts here in a fresh
interpreter, as it would have without warm workers, after one line on stderr.

Standard library only, and run by path (``fsdp_ext/__init__`` imports torch, which is the
cost this client exists to avoid).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import sys

from wire import NAMESPACES, receive, send

__all__ = ["CLIENT_ENV", "FORWARDED", "SOCKET_ENV", "main"]

SOCKET_ENV = "FSDP_EXT_WARM_SOCKET"
CLIENT_ENV = "FSDP_EXT_WARM_CLIENT"  # in the worker's environment: this client's pid
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
PR_SET_PDEATHSIG = 1
USAGE = "usage: client.py [--socket PATH] (SCRIPT | -m MODULE) ARGS..."


def _parse(argv: list[str]) -> tuple[str, bool, list[str]]:
    """(socket path, run as module, [SCRIPT or MODULE, ARGS...])."""
    path = os.environ.get(SOCKET_ENV, "")
    if argv[:1] == ["--socket"] and len(argv) > 1:
        path, argv = argv[1], argv[2:]
    elif argv[:1] and argv[0].startswith("--socket="):
        path, argv = argv[0].split("=", 1)[1], argv[1:]
    module = argv[:1] == ["-m"]
    target = argv[1:] if module else argv
    if not path or not target:
        sys.exit(f"{USAGE}\n(the socket comes from --socket or ${SOCKET_ENV})")
    return path, module, target


def _die_with_launcher(launcher: int) -> None:
    """SIGKILL this process when its parent (the launcher) exits, or now if it did."""
    with contextlib.suppress(OSError, AttributeError):  # not Linux: no tie
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != launcher:
        os.kill(os.getpid(), signal.SIGKILL)


def _namespaces() -> list[int]:
    """Descriptors of this process's NAMESPACES (none where one is absent)."""
    fds = []
    for kind in NAMESPACES:
        with contextlib.suppress(OSError):
            fds.append(os.open(f"/proc/self/ns/{kind}", os.O_RDONLY | os.O_CLOEXEC))
    return fds if len(fds) == len(NAMESPACES) else []


def _unbuffered() -> bool:
    """Whether this interpreter runs with -u (or PYTHONUNBUFFERED): so will the program."""
    return bool(getattr(sys.stdout, "write_through", False) or os.environ.get("PYTHONUNBUFFERED"))


def _fresh(module: bool, target: list[str], why: str) -> None:
    """No warm server: become the program in a fresh interpreter (exec, same pid)."""
    print(f"warm: {why}; starting {target[0]} in a fresh interpreter", file=sys.stderr, flush=True)
    flags = ["-u"] if _unbuffered() else []
    os.execv(sys.executable, [sys.executable, *flags, *(["-m"] if module else []), *target])


def _end_as(status: int) -> None:
    """Exit as the worker did: its exit code, or death by its signal."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
        sys.exit(128 + sig)  # a signal whose default is not to end the process
    sys.exit(os.waitstatus_to_exitcode(status))


def main(argv: list[str] | None = None) -> None:
    launcher = os.getppid()
    path, module, target = _parse(sys.argv[1:] if argv is None else argv)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
    except OSError as exc:
        sock.close()
        _fresh(module, target, f"no warm server at {path} ({exc.strerror or exc})")
    _die_with_launcher(launcher)
    pending: list[int] = []  # signals that came before the worker's pid
    worker: list[int] = []

    def forward(sig: int, _frame) -> None:
        if worker:
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker[0], sig)
        else:
            pending.append(sig)

    for sig in FORWARDED:
        signal.signal(sig, forward)
    request = {
        "argv": target,
        "module": module,
        "env": {**os.environ, CLIENT_ENV: str(os.getpid())},
        "cwd": os.getcwd(),
        "unbuffered": _unbuffered(),
    }
    try:
        send(sock, request, (0, 1, 2, *_namespaces()))
        started, _ = receive(sock)
    except OSError as exc:
        _fresh(module, target, f"the warm server at {path} failed ({exc})")
    if started is None or "pid" not in started:
        why = (started or {}).get("error", "it closed the connection")
        _fresh(module, target, f"the warm server at {path} did not start the program: {why}")
    worker.append(started["pid"])
    for sig in pending:
        forward(sig, None)
    ended, _ = receive(sock)
    if ended is None:
        print(
            f"warm: the server at {path} went away; worker {worker[0]}'s status is unknown",
            file=sys.stderr,
            flush=True,
        )
        sys.exit(1)
    _end_as(ended["status"])


if __name__ == "__main__":
    main()
