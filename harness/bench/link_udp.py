"""The numbered UDP datagrams of ``bench-link``'s loss and impairment trials: the scripts a worker and
the coordinator run (``python -c``, no shell; only the standard library), their port, and one loss trial
between any two peers with the docker SDK's ``exec_run(argv, demux=True)`` (`udp_trial`): containers
(`harness.bench.link_loss`) or network namespaces (`harness.bench.link_netem.NetnsPeer`)."""

from __future__ import annotations

import json
import threading
from typing import Any

PORT = 5021
# Receiver: distinct sequence numbers until 2 s of silence after the first datagram; prints JSON. A datagram
# numbered READY is the sender's hello, answered (the sender waits for it: a receiver may start after it).
RECEIVE = """
import json, socket, sys
READY = (1 << 64) - 1
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
s.bind(("0.0.0.0", int(sys.argv[1]))); s.settimeout(60); got = set()
try:
    while True:
        data, addr = s.recvfrom(64); seq = int.from_bytes(data[:8], "big")
        if seq == READY:
            s.sendto(b"ready", addr); continue
        got.add(seq); s.settimeout(2)
except socket.timeout:
    pass
print(json.dumps({"received": len(got)}))
"""
# Sender: hello (READY) every 0.2 s until the receiver answers (60 s at most), then argv[3] datagrams of
# 64 bytes, paced by a 1 ms pause every 200 (no receive-buffer overflow).
SEND = """
import socket, sys, time
READY = (1 << 64) - 1
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); addr = (sys.argv[1], int(sys.argv[2])); pad = bytes(56)
s.settimeout(0.2)
for _ in range(300):
    s.sendto(READY.to_bytes(8, "big") + pad, addr)
    try:
        s.recv(64); break
    except socket.timeout:
        pass
else:
    sys.exit("no receiver answered the hello")
for i in range(int(sys.argv[3])):
    s.sendto(i.to_bytes(8, "big") + pad, addr)
    if i % 200 == 199:
        time.sleep(0.001)
"""

# Receiver: the sequence numbers in arrival order (copies too) until 2 s of silence, the hello answered;
# prints JSON.
RECEIVE_ORDER = """
import json, socket, sys
READY = (1 << 64) - 1
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
s.bind(("0.0.0.0", int(sys.argv[1]))); s.settimeout(60); got = []
try:
    while True:
        data, addr = s.recvfrom(64); seq = int.from_bytes(data[:8], "big")
        if seq == READY:
            s.sendto(b"ready", addr); continue
        got.append(seq); s.settimeout(2)
except socket.timeout:
    pass
print(json.dumps(got))
"""


def udp_trial(receiver, sender, receiver_host: str, packets: int, what: str) -> int:
    """`packets` numbered datagrams from `sender` to `receiver` (anything with ``exec_run(argv,
    demux=True)``, as docker SDK containers; `receiver_host` is the receiver's name or address): the
    number of distinct ones received. Raises RuntimeError (naming `what`) when either end fails."""
    result: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: result.update(
        exec=receiver.exec_run(["python", "-c", RECEIVE, str(PORT)], demux=True)))
    thread.start()
    code, out = sender.exec_run(["python", "-c", SEND, receiver_host, str(PORT), str(packets)])
    thread.join(timeout=120)
    if code != 0 or "exec" not in result or result["exec"][0] != 0:
        raise RuntimeError(f"bench-link: the UDP trial at {what} failed: {out!r} {result.get('exec')!r}")
    return json.loads(result["exec"][1][0])["received"]
