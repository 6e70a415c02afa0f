"""The warm server's wire: length-prefixed JSON messages over a Unix stream socket, with
file descriptors passed alongside (SCM_RIGHTS).

Standard library only: the client imports it, and the client must start in milliseconds.
"""

from __future__ import annotations

import json
import socket
import struct

__all__ = ["MAX_FDS", "NAMESPACES", "receive", "send"]

# the client's namespaces whose descriptors follow its stdio, in this order; the worker joins
# them: its network, files and host name
NAMESPACES = ("net", "mnt", "uts")
MAX_FDS = 3 + len(NAMESPACES)  # stdin, stdout, stderr, then NAMESPACES
_HEAD = struct.Struct("!I")


def send(sock: socket.socket, message: dict, fds: tuple[int, ...] = ()) -> None:
    """Send one message, and ``fds`` with its first byte."""
    data = json.dumps(message).encode()
    frame = _HEAD.pack(len(data)) + data
    sent = socket.send_fds(sock, [frame], list(fds)) if fds else 0
    sock.sendall(frame[sent:])


def _exactly(sock: socket.socket, size: int) -> bytes | None:
    data = b""
    while len(data) < size:
        more = sock.recv(size - len(data))
        if not more:
            return None
        data += more
    return data


def receive(sock: socket.socket) -> tuple[dict | None, list[int]]:
    """One message and the descriptors that came with it; (None, []) at end of stream (the
    peer closed its end, or died)."""
    head, fds, _flags, _addr = socket.recv_fds(sock, _HEAD.size, MAX_FDS)
    if not head:
        return None, fds
    rest = _exactly(sock, _HEAD.size - len(head))
    if rest is None:
        return None, fds
    (size,) = _HEAD.unpack(head + rest)
    data = _exactly(sock, size)
    if data is None:
        return None, fds
    return json.loads(data), fds
