"""A plain TCP transfer, for measuring a lab link's rate (standard library only).

throughput.py serve PORT CONNECTIONS   # prints "listening", then one JSON line
throughput.py send HOST PORT BYTES
"""

import json
import socket
import sys
import threading
import time

CHUNK = 1 << 16
# Deep socket buffers (and a high priority, set by the test) keep the link, not a busy CPU,
# the bottleneck: a receiver that waits 200 ms for a core still finds its data queued.
BUFFER = 8 << 20


def serve(port: int, connections: int) -> None:
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, BUFFER)  # inherited on accept
    server.bind(("0.0.0.0", port))
    server.listen(connections)
    print("listening", flush=True)
    received = [0] * connections
    first, last = [], []

    def drain(conn: socket.socket, i: int) -> None:
        with conn:
            while data := conn.recv(1 << 20):
                if not first:
                    first.append(time.perf_counter())
                received[i] += len(data)
        last.append(time.perf_counter())

    threads = []
    for i in range(connections):
        conn, _ = server.accept()
        threads.append(threading.Thread(target=drain, args=(conn, i)))
        threads[-1].start()
    for thread in threads:
        thread.join()
    print(json.dumps({"bytes": received, "seconds": max(last) - first[0]}), flush=True)


def send(host: str, port: int, total: int) -> None:
    payload = b"\0" * CHUNK
    with socket.socket() as conn:
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, BUFFER)
        conn.connect((host, port))
        sent = 0
        while sent < total:
            conn.sendall(payload[: min(CHUNK, total - sent)])
            sent += min(CHUNK, total - sent)


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(int(sys.argv[2]), int(sys.argv[3]))
    else:
        send(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
