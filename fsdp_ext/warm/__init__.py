"""Warm workers: a per-node server that imports torch once and forks each worker from it,
so a restarted worker starts in milliseconds instead of paying the imports again.

    python fsdp_ext/warm/server.py --socket PATH --preload examples.train &
    torchrun ... fsdp_ext/warm/client.py --socket PATH examples/train.py ARGS...

``SERVER`` and ``CLIENT`` are the two scripts' paths: both are run by path, never imported
through this package (the client must not import torch). See docs/recovery.md.
"""

from __future__ import annotations

import pathlib

__all__ = ["CLIENT", "CLIENT_ENV", "SERVER", "SOCKET_ENV", "client_argv", "server_argv"]

CLIENT = pathlib.Path(__file__).resolve().with_name("client.py")
SERVER = pathlib.Path(__file__).resolve().with_name("server.py")
# a launcher that finds a socket here starts its workers through CLIENT (client.py reads it too)
SOCKET_ENV = "FSDP_EXT_WARM_SOCKET"
# a forked worker finds its client's pid here: the client, not the server, is its launcher's child
CLIENT_ENV = "FSDP_EXT_WARM_CLIENT"


def server_argv(python: str, socket_path: str, preload: tuple[str, ...] = ()) -> list[str]:
    """The command line of a node's warm server."""
    argv = [python, str(SERVER), "--socket", socket_path]
    for module in preload:
        argv += ["--preload", module]
    return argv


def client_argv(socket_path: str, program: list[str]) -> list[str]:
    """``program`` (SCRIPT ARGS...) as the launcher's script: the client, then the program."""
    return [str(CLIENT), "--socket", socket_path, *program]
