"""Capture the tc read-back fixtures of this folder on the machine itself (needs root and veth).

Two network namespaces joined by a veth pair (``eth0`` in each, 198.18.0.1 and 198.18.0.2: RFC 2544's
benchmarking range, reachable only inside the pair) stand in for two containers on one bridge. For
each case the profile's own commands (`harness.links.tc.profile_commands`) shape the first
namespace's ``eth0``, a Python TCP bulk transfer runs across the pair (both ways for ingress), and
the read-back is saved as tc printed it:

- ``CASE-qdisc-DEV.json``: ``tc -j -s qdisc show dev DEV`` with the system's tc (`--tc`; the node
  image's iproute2 6.1.0),
- ``CASE-class-DEV.json``: ``tc -j -s class show dev DEV`` with a tc that prints classes as JSON
  (`--tc-json-classes`; iproute2 >= 6.2),
- ``CASE-class-DEV.txt``: the same class read with the system's tc, which prints classes as text even
  with ``-j`` (iproute2 6.1.0), read right after the JSON one once the link is idle.

Usage (as root, from the repository): ``python tests/unit/tc_fixtures/capture.py --tc-json-classes
/path/to/iproute2-6.15/tc/tc``. The namespaces are deleted at the end, also on failure.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from harness.links.tc import IFB_DEV, profile_commands  # noqa: E402
from harness.spec.links import LinkProfile  # noqa: E402

HERE = Path(__file__).parent
NS_A, NS_B = "wiiide-tcfix-a", "wiiide-tcfix-b"
ADDR_A, ADDR_B = "198.18.0.1", "198.18.0.2"
PORT = 5001
TRANSFER_S = 3.0

RECEIVE = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(1); s.settimeout(20)
c, _ = s.accept(); c.settimeout(20); buf = bytearray(1 << 20)
while c.recv_into(buf):
    pass
"""
SEND = """
import socket, sys, time
for _ in range(100):
    try:
        s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5); break
    except OSError:
        time.sleep(0.05)
data = b"\\0" * (1 << 16); end = time.perf_counter() + float(sys.argv[3])
while time.perf_counter() < end:
    s.sendall(data)
s.close()
"""

CASES = {
    "unshaped": None,
    "htb-100mbit": LinkProfile(rate_bps=100_000_000),
    "tbf-10mbit": LinkProfile(rate_bps=10_000_000, root_qdisc="tbf"),
    "htb-1gbit-pfifo": LinkProfile(rate_bps=1_000_000_000, limit_packets=500),
    "htb-50mbit-ingress": LinkProfile(rate_bps=50_000_000, ingress=True),
}


def run(*argv: str, ns: str | None = None) -> str:
    prefix = ["ip", "netns", "exec", ns] if ns else []
    return subprocess.run([*prefix, *argv], check=True, capture_output=True, text=True).stdout


def make_pair() -> None:
    run("ip", "netns", "add", NS_A)
    run("ip", "netns", "add", NS_B)
    run("ip", "link", "add", "eth0", "type", "veth", "peer", "name", "eth0", "netns", NS_B, ns=NS_A)
    for ns, addr in ((NS_A, ADDR_A), (NS_B, ADDR_B)):
        run("ip", "addr", "add", f"{addr}/24", "dev", "eth0", ns=ns)
        run("ip", "link", "set", "eth0", "up", ns=ns)
        run("ip", "link", "set", "lo", "up", ns=ns)


def delete_pair() -> None:
    for ns in (NS_A, NS_B):
        subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True)


def transfer(src: str, dst: str, dst_addr: str, seconds: float = TRANSFER_S) -> None:
    """A TCP bulk transfer from namespace `src` to `dst` for `seconds`; returns when it is over."""
    receiver = subprocess.Popen(["ip", "netns", "exec", dst, sys.executable, "-c", RECEIVE, dst_addr, str(PORT)])
    time.sleep(0.3)
    run(sys.executable, "-c", SEND, dst_addr, str(PORT), str(seconds), ns=src)
    receiver.wait(timeout=30)


def save(name: str, text: str) -> None:
    (HERE / name).write_text(text if text.endswith("\n") else text + "\n")
    print(f"wrote {name}")


def capture(case: str, profile: LinkProfile | None, tc: str, tc_json_classes: str) -> None:
    if profile is not None:
        for argv in profile_commands(profile):
            run(*argv, ns=NS_A)
    if case == "tbf-10mbit":  # a read while the queue is busy, then the rest once idle
        busy = threading.Thread(target=transfer, args=(NS_A, NS_B, ADDR_B))
        busy.start()
        time.sleep(TRANSFER_S / 2)
        save(f"{case}-busy-qdisc-eth0.json", run(tc, "-j", "-s", "qdisc", "show", "dev", "eth0", ns=NS_A))
        busy.join()
    elif profile is not None:
        transfer(NS_A, NS_B, ADDR_B)
        if profile.ingress:
            transfer(NS_B, NS_A, ADDR_A)
    time.sleep(0.5)
    devices = ["eth0", IFB_DEV] if profile is not None and profile.ingress else ["eth0"]
    for dev in devices:
        save(f"{case}-qdisc-{dev}.json", run(tc, "-j", "-s", "qdisc", "show", "dev", dev, ns=NS_A))
        save(f"{case}-class-{dev}.json", run(tc_json_classes, "-j", "-s", "class", "show", "dev", dev, ns=NS_A))
        save(f"{case}-class-{dev}.txt", run(tc, "-j", "-s", "class", "show", "dev", dev, ns=NS_A))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tc", default="tc", help="the tc of the node image's iproute2 (6.1.0)")
    parser.add_argument("--tc-json-classes", required=True, help="a tc of iproute2 >= 6.2 (JSON classes)")
    args = parser.parse_args()
    for case, profile in CASES.items():
        delete_pair()
        make_pair()
        try:
            capture(case, profile, args.tc, args.tc_json_classes)
        finally:
            delete_pair()


if __name__ == "__main__":
    main()
