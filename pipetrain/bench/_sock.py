"""A minimal iperf: ``recv HOST PORT`` prints what arrived as JSON; ``send HOST PORT SECONDS`` streams zeros."""
from __future__ import annotations

import json
import socket
import sys
import time

CHUNK = 1 << 20


def recv(host: str, port: int) -> dict[str, float]:
    with socket.create_server((host, port)) as srv:
        conn, _ = srv.accept()
        with conn:
            buf = bytearray(CHUNK)
            n = conn.recv_into(buf)
            first = time.perf_counter()
            total = n
            while n:
                n = conn.recv_into(buf)
                total += n
            seconds = time.perf_counter() - first
    return {"bits_per_s": 8 * total / seconds, "bytes": total, "seconds": seconds}


def send(host: str, port: int, seconds: float) -> None:
    deadline = time.monotonic() + 10
    while True:  # the receiver may not be listening yet
        try:
            sock = socket.create_connection((host, port), timeout=10)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    data = bytes(CHUNK)
    with sock:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            sock.sendall(data)


if __name__ == "__main__":
    if sys.argv[1] == "recv":
        print(json.dumps(recv(sys.argv[2], int(sys.argv[3]))))
    else:
        send(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]))
