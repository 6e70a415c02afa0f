"""What a fork of the warm server does to become its client's program.

It joins the client's network, mount and UTS namespaces where they are not the server's (a
server outside a node, such as the lab's pre-booted spare, serves that node's clients so;
it needs CAP_SYS_ADMIN), takes the client's environment, working directory, argv and
stdin/stdout/stderr, puts
back the default signal handlers, leaves the server's session, and runs the program as
``__main__`` (runpy), as ``python SCRIPT`` or ``python -m MODULE`` would. Two things a
fresh interpreter would have and a fork lacks are given back:

- /proc/PID/environ: a fork shows its parent's environment there, whatever os.environ says.
  Tools find a job's processes by it (a rank by ``RANK``, a lab job by its mark), so the
  client's environment is written over the server's initial block (padded for the
  purpose, see server.py ``ROOM_ENV``).
- the tie to the launcher: the worker is the server's child, not the launcher's, so a
  launcher that SIGKILLs its worker (the client) would leave it running. A watchdog thread
  blocks on the client's connection and SIGKILLs the worker when it closes (the client
  died, whatever killed it).

What a fork cannot take from the client: anything read once at import by the modules the
server preloaded (PYTHONHASHSEED, interpreter flags, OMP_NUM_THREADS as libgomp read it;
torch's thread count is set again from OMP_NUM_THREADS here).
"""

from __future__ import annotations

import atexit
import ctypes
import gc
import io
import os
import random
import runpy
import signal
import socket
import sys
import threading
from dataclasses import dataclass

from wire import NAMESPACES

__all__ = ["Request", "become", "show_environ"]


@dataclass
class Request:
    """One client's program and context, as the server received it."""

    argv: list[str]
    module: bool
    env: dict[str, str]
    cwd: str
    unbuffered: bool
    fds: list[int]  # the client's stdin, stdout, stderr
    namespaces: list[int]  # the client's network, mount and UTS namespaces, or none
    conn: socket.socket  # the client's connection: it closes when the client dies
    inherited: list[socket.socket]  # the server's connections to other clients

    @classmethod
    def from_message(
        cls, message: dict, fds: list[int], conn: socket.socket, inherited: list[socket.socket]
    ) -> Request:
        return cls(
            argv=[str(a) for a in message["argv"]],
            module=bool(message.get("module")),
            env={str(k): str(v) for k, v in message["env"].items()},
            cwd=str(message["cwd"]),
            unbuffered=bool(message.get("unbuffered")),
            fds=fds[:3],
            namespaces=fds[3:],
            conn=conn,
            inherited=inherited,
        )


def show_environ(env: dict[str, str]) -> bool:
    """Write ``env`` over this process's initial environment block, so /proc/PID/environ
    shows it (whole entries, as many as fit); whether all fit. Call it after os.environ
    was replaced: nothing in the C environment points into the old block then."""
    with open("/proc/self/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    start, end = int(fields[47]), int(fields[48])  # env_start, env_end (fields 50, 51)
    room, block, whole = end - start, b"", True
    for key, value in env.items():
        entry = f"{key}={value}".encode(errors="surrogateescape") + b"\0"
        if len(block) + len(entry) > room:
            whole = False
            continue
        block += entry
    ctypes.memmove(start, block.ljust(room, b"\0"), room)
    return whole


def _join(namespaces: list[int]) -> None:
    """Enter the client's network, mount and UTS namespaces where they differ from this
    process's (a single-threaded fork may join a mount namespace): a worker for a client on
    another emulated host sees that host's files, boot id and host name."""
    libc = ctypes.CDLL(None, use_errno=True)
    for fd, kind in zip(namespaces, NAMESPACES, strict=True):
        other = os.fstat(fd).st_ino != os.stat(f"/proc/self/ns/{kind}").st_ino
        if other and libc.setns(fd, 0) != 0:
            err = ctypes.get_errno()
            why = f"warm: joining the client's {kind} namespace: {os.strerror(err)}"
            raise OSError(err, why)
        os.close(fd)


def _watch(conn: socket.socket) -> None:
    """SIGKILL this process once the client's connection closes (the client died)."""
    try:
        while conn.recv(64):
            pass
    except OSError:
        pass
    os.kill(os.getpid(), signal.SIGKILL)


def _stdio(unbuffered: bool) -> None:
    """Python's standard streams over the client's descriptors (0, 1, 2 after dup2)."""
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))

    def writer(fd: int, errors: str) -> io.TextIOWrapper:
        raw = io.FileIO(fd, "w", closefd=False)
        binary = raw if unbuffered else io.BufferedWriter(raw)
        interactive = raw.isatty() or fd == 2
        return io.TextIOWrapper(
            binary, errors=errors, line_buffering=interactive, write_through=unbuffered
        )

    sys.stdout = sys.__stdout__ = writer(1, "strict")
    sys.stderr = sys.__stderr__ = writer(2, "backslashreplace")


def _search_path(request: Request) -> list[str]:
    """sys.path as ``python SCRIPT`` (the script's folder first) or ``python -m`` (the
    working directory) would start with it under the client's PYTHONPATH."""
    first = request.cwd if request.module else os.path.dirname(os.path.abspath(request.argv[0]))
    ours = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    theirs = [p for p in request.env.get("PYTHONPATH", "").split(os.pathsep) if p]
    rest = [p for p in sys.path[1:] if p not in ours]
    return [first, *theirs, *rest]


def become(request: Request) -> None:
    """Turn this fresh fork into the client's program, and run it (exits as it exits)."""
    _join(request.namespaces)
    os.setsid()
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for conn in request.inherited:
        conn.close()
    for target, fd in enumerate(request.fds):
        os.dup2(fd, target)
        os.close(fd)
    _stdio(request.unbuffered)
    os.chdir(request.cwd)
    sys.path[:] = _search_path(request)
    os.environ.clear()
    os.environ.update(request.env)
    show_environ(request.env)
    # the server froze its objects out of the collector's sight (server.py: copy on write);
    # at exit they are collected again, as a fresh interpreter's are (native bindings such
    # as triton's nanobind report every object left alive at exit)
    atexit.register(gc.unfreeze)
    random.seed()  # a fresh interpreter seeds from the OS; every fork shares the server's
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    threads = request.env.get("OMP_NUM_THREADS", "")
    if "torch" in sys.modules and threads.isdigit() and int(threads) > 0:
        sys.modules["torch"].set_num_threads(int(threads))
    threading.Thread(target=_watch, args=(request.conn,), daemon=True, name="warm-watchdog").start()
    sys.argv = list(request.argv)
    if request.module:
        # runs anew as __main__, as ``python -m`` does (the server may have imported it)
        sys.modules.pop(request.argv[0], None)
        runpy.run_module(request.argv[0], run_name="__main__", alter_sys=True)
    else:
        runpy.run_path(request.argv[0], run_name="__main__")
