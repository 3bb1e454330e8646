"""The numbered UDP datagrams of ``bench-link``'s loss and impairment trials: the scripts a worker and
the coordinator run (``python -c``, no shell) and their port."""

PORT = 5021
# Receiver: distinct sequence numbers until 2 s of silence after the first datagram; prints JSON.
RECEIVE = """
import json, socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
s.bind(("0.0.0.0", int(sys.argv[1]))); s.settimeout(60); got = set()
try:
    while True:
        got.add(int.from_bytes(s.recv(64)[:8], "big")); s.settimeout(2)
except socket.timeout:
    pass
print(json.dumps({"received": len(got)}))
"""
# Sender: argv[3] datagrams of 64 bytes, paced by a 1 ms pause every 200 (no receive-buffer overflow).
SEND = """
import socket, sys, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); addr = (sys.argv[1], int(sys.argv[2])); pad = bytes(56)
for i in range(int(sys.argv[3])):
    s.sendto(i.to_bytes(8, "big") + pad, addr)
    if i % 200 == 199:
        time.sleep(0.001)
"""

# Receiver: the sequence numbers in arrival order (copies too) until 2 s of silence; prints JSON.
RECEIVE_ORDER = """
import json, socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
s.bind(("0.0.0.0", int(sys.argv[1]))); s.settimeout(60); got = []
try:
    while True:
        got.append(int.from_bytes(s.recv(64)[:8], "big")); s.settimeout(2)
except socket.timeout:
    pass
print(json.dumps(got))
"""
