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


def serve(port: int, connections: int) -> None:
    server = socket.create_server(("0.0.0.0", port), backlog=connections)
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
    with socket.create_connection((host, port)) as conn:
        sent = 0
        while sent < total:
            conn.sendall(payload[: min(CHUNK, total - sent)])
            sent += min(CHUNK, total - sent)


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(int(sys.argv[2]), int(sys.argv[3]))
    else:
        send(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
