"""The attacker of ``bench-handshake`` (`harness.bench.handshake`): strangers that hold or flood a
coordinator's handshake slots, run as a subprocess so that its CPU is not the probe's.

    python -m harness.bench.handshake_attack slowloris|flood --port PORT --connections N --attack-s S

prints its counts as one JSON line when it ends (after `--attack-s` seconds, or at SIGTERM). The
connections go only to 127.0.0.1, from `ATTACKER_ADDRESS` (Linux routes all of 127.0.0.0/8 to lo, so
the coordinator sees another peer address than the probe's).
"""

from __future__ import annotations

import argparse
import json
import select
import signal
import socket
import sys
import time
from typing import Any, Sequence

from wiiide.wire.format import MAGIC, PREFIX, PROTOCOL_VERSION

KINDS = ("slowloris", "flood")
ATTACKER_ADDRESS = "127.0.0.2"

IP_BIND_ADDRESS_NO_PORT = getattr(socket, "IP_BIND_ADDRESS_NO_PORT", 24)  # Linux, include/uapi/linux/in.h


def _open(port: int, source: str, counts: dict[str, int]) -> socket.socket | None:
    """A connection from `source` (its port chosen at connect, so thousands of short connections do
    not run into ports still in use); None, counted by error, when it cannot be made."""
    sock = socket.socket()
    try:
        sock.setsockopt(socket.IPPROTO_IP, IP_BIND_ADDRESS_NO_PORT, 1)
        sock.bind((source, 0))
        sock.settimeout(2.0)
        sock.connect(("127.0.0.1", port))
        sock.setblocking(False)
        return sock
    except OSError as exc:
        key = f"connect_failed_{type(exc).__name__}"
        counts[key] = counts.get(key, 0) + 1
        sock.close()
        return None


def _closed_by_peer(sock: socket.socket) -> bool:
    """Drain what the coordinator sent (its challenge); True once it closed the connection."""
    try:
        while True:
            if not sock.recv(65536):
                return True
    except BlockingIOError:
        return False
    except OSError:
        return True


def attack(kind: str, port: int, connections: int, duration_s: float, source: str = ATTACKER_ADDRESS,
           counts: dict[str, int] | None = None) -> dict[str, int]:
    """Run one attack on 127.0.0.1:`port` from `source` for `duration_s` seconds (module docstring).

    Returns `counts` (updated in place as it goes, so an interrupted attack still has them):
    ``opened`` (connections established), ``connect_failed``, ``closed_by_peer`` and ``bytes_sent``.
    """
    counts = counts if counts is not None else {}
    counts.update({"opened": 0, "closed_by_peer": 0, "bytes_sent": 0, "connect_failed": 0})
    end = time.monotonic() + duration_s
    socks: list[socket.socket] = []

    def send(sock: socket.socket, data: bytes) -> None:
        try:
            counts["bytes_sent"] += sock.send(data)
        except OSError:
            pass

    prefix = PREFIX.pack(MAGIC, PROTOCOL_VERSION, 0, 64, 4 << 30)
    if kind == "slowloris":
        sent_of: dict[socket.socket, int] = {}
        while time.monotonic() < end:
            while len(socks) < connections and time.monotonic() < end:
                sock = _open(port, source, counts)
                if sock is None:
                    counts["connect_failed"] += 1
                    time.sleep(0.1)
                    continue
                counts["opened"] += 1
                socks.append(sock)
                sent_of[sock] = 0
            tick = time.monotonic() + 1.0
            for sock in list(socks):
                if _closed_by_peer(sock):
                    counts["closed_by_peer"] += 1
                    socks.remove(sock)
                    sent_of.pop(sock, None)
                    sock.close()
                    continue
                i = sent_of[sock]
                send(sock, prefix[i:i + 1] if i < len(prefix) else b"{")
                sent_of[sock] = i + 1
            time.sleep(max(0.0, tick - time.monotonic()))
    elif kind == "flood":
        while time.monotonic() < end:
            for i in range(connections):
                sock = _open(port, source, counts)
                if sock is None:
                    counts["connect_failed"] += 1
                    continue
                counts["opened"] += 1
                send(sock, b"GET / HTTP/1.1\r\n\r\n" if i % 2 else b"\x00" * 3)
                socks.append(sock)
            while socks and time.monotonic() < end:
                readable, _, _ = select.select(socks[:1000], [], [], 0.2)
                for sock in readable:
                    if _closed_by_peer(sock):
                        counts["closed_by_peer"] += 1
                        socks.remove(sock)
                        sock.close()
            time.sleep(1.0)
    else:
        raise ValueError(f"attack kind {kind!r}; allowed: slowloris, flood")
    for sock in socks:
        sock.close()
    return counts


def main(argv: Sequence[str] | None = None) -> int:
    """Run one attack until `--attack-s` seconds are over or SIGTERM comes; print the counts as JSON."""
    parser = argparse.ArgumentParser(prog="python -m harness.bench.handshake_attack",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("kind", choices=KINDS)
    parser.add_argument("--port", type=int, required=True, help="the coordinator's, on 127.0.0.1")
    parser.add_argument("--connections", type=int, required=True)
    parser.add_argument("--attack-s", type=float, required=True, help="seconds before the attack stops")
    args = parser.parse_args(argv)

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt()

    counts: dict[str, int] = {}
    signal.signal(signal.SIGTERM, interrupt)
    try:
        attack(args.kind, args.port, args.connections, args.attack_s, counts=counts)
    except KeyboardInterrupt:
        pass
    print(json.dumps(counts), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
