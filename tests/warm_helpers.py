"""A real warm worker server (fsdp_ext/warm) for a test: started, waited for, stopped."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from fsdp_ext.warm import CLIENT, server_argv

READY_S = 180.0  # the server imports torch before it forks (12-37 s on a loaded machine)


@contextlib.contextmanager
def warm_server(
    where: Path, preload: tuple[str, ...] = (), env: dict[str, str] | None = None
) -> Iterator[tuple[str, subprocess.Popen]]:
    """A server on ``where/s.sock``, its log in ``where/server.log``; yields (socket, process)
    once it is ready (its imports done), and stops it (SIGTERM, then SIGKILL) after."""
    path = str(where / "s.sock")
    log_path = where / "server.log"
    with open(log_path, "w+") as log:
        proc = subprocess.Popen(
            server_argv(sys.executable, path, preload),
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        try:
            deadline = time.monotonic() + READY_S
            while "warm: ready" not in log_path.read_text():
                assert proc.poll() is None, log_path.read_text()
                assert time.monotonic() < deadline, "the warm server did not get ready"
                time.sleep(0.1)
            yield path, proc
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=30)
        finally:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def forked_warm(socket_path: str, *argvs: list[str]) -> Iterator[None]:
    """Within: each of ``argvs`` (a command line that starts with ``sys.executable``; changed
    in place) starts its program through the warm client on ``socket_path``, a fork of that
    server, instead of a fresh interpreter; fresh again after."""
    client = [sys.executable, str(CLIENT), "--socket", socket_path]
    for argv in argvs:
        argv[:1] = client
    try:
        yield
    finally:
        for argv in argvs:
            argv[: len(client)] = [sys.executable]
