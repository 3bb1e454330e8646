"""Docker tests of the link fallback where a kernel has no netem: random loss applied with iptables'
``statistic`` match on the packets a container receives (`harness.links.fallback`), and delay through
the delay line (`harness.links.delayline`). On a pair held at the start gate, the mechanism's own
counters show drops, a TCP transfer still delivers every byte (TCP retransmits what was dropped), and a
reset leaves neither the chain nor a qdisc behind; the delay line holds the round trip above the delay
asked, a killed delay line lets traffic through (queue bypass), and its reset leaves no rule, no bound
queue and no process.

Fidelity (how close the counted loss comes to what was asked) is a benchmark's figure, not a pass/fail
here: the test checks only that the mechanism acts, and that it does not drop several times too much."""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time

import pytest

from harness.links import rtt
from harness.links.fallback import CHAIN, DELAY_LINE_MECHANISM, STATISTIC
from harness.links.plan import plan_shaping
from harness.run.compose_file import PROJECT_LABEL
from harness.run.compose_project import PROJECT, cluster_down, cluster_up
from harness.run.docker_client import docker_client
from harness.run.image import DEFAULT_TAG
from harness.run.shaping import START_GATE_FILE, container_identity
from harness.run.tc_exec import (ContainerExec, apply_plan, probe_capabilities, read_delay_line_stats,
                                 read_fallback_counters, reset_links)
from harness.spec.links import LinkProfile
from tests.docker.test_links import CONNECT
from wiiide.config import RunConfig

pytestmark = pytest.mark.docker

LOSS_PCT = 5.0
TRANSFER_BYTES = 16 << 20
PORT = 5011
# Receiver: counts bytes until the sender closes; prints JSON. No shell anywhere.
RECEIVE = """
import json, socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", int(sys.argv[1]))); s.listen(1); s.settimeout(60)
c, _ = s.accept(); c.settimeout(60); buf = bytearray(1 << 20); n = 0
while True:
    k = c.recv_into(buf)
    if not k:
        break
    n += k
print(json.dumps({"bytes": n}))
"""
# Sender: a fixed number of bytes, then a clean close.
SEND = CONNECT + """
left = int(sys.argv[3]); chunk = b"\\0" * (1 << 20)
while left > 0:
    s.sendall(chunk[:left]); left -= min(left, len(chunk))
s.shutdown(socket.SHUT_WR); s.recv(1); s.close()
"""


def image() -> str:
    return os.environ.get("WIIIIIDE_IMAGE", DEFAULT_TAG)


def transfer(sender, receiver, receiver_host: str, n_bytes: int) -> int:
    """Send `n_bytes` over one TCP connection from `sender` to `receiver` (containers); the bytes the
    receiver counted before the sender's close."""
    result = {}

    def receive() -> None:
        result["exec"] = receiver.exec_run(["python", "-c", RECEIVE, str(PORT)], demux=True)

    thread = threading.Thread(target=receive)
    thread.start()
    code, out = sender.exec_run(["python", "-c", SEND, receiver_host, str(PORT), str(n_bytes)])
    thread.join(timeout=120)
    assert code == 0, out
    code, (out, err) = result["exec"]
    assert code == 0, err
    return json.loads(out)["bytes"]


def qdisc_kinds(runner: ContainerExec) -> list[str]:
    return [q["kind"] for q in json.loads(runner.run(["tc", "-j", "qdisc", "show", "dev", "eth0"]))]


def fallback_rules(runner: ContainerExec) -> list[str]:
    """The lines of ``iptables -t mangle -S`` that name the fallback's chain."""
    return [line for line in runner.run(["iptables", "-w", "-t", "mangle", "-S"]).splitlines() if CHAIN in line]


@pytest.fixture(scope="module")
def lossy_pair(docker_ready, tmp_path_factory):
    """A coordinator and one worker held at the start gate (no training traffic), the coordinator's
    arriving packets dropped at LOSS_PCT through the fallback (netem taken as absent, even where the
    kernel has it), and the coordinator's qdiscs before shaping."""
    cfg = RunConfig(num_workers=1, duration_s=60, connect_timeout_s=120, start_gate_file=START_GATE_FILE,
                    log_tier="silent")
    containers = cluster_up(cfg, tmp_path_factory.mktemp("fallback-cluster"), image())
    try:
        by_role = {container_identity(c)[0]: c for c in containers}
        caps = probe_capabilities(docker_client(), image())
        assert caps.statistic, f"the node image or kernel has no iptables statistic match: {caps.errors}"
        plan = plan_shaping(LinkProfile(loss_pct=LOSS_PCT), dataclasses.replace(caps, netem=False))
        runner = ContainerExec(by_role["coordinator"])
        default_qdiscs = qdisc_kinds(runner)
        apply_plan(runner, plan)
        yield by_role, plan, default_qdiscs
    finally:
        cluster_down(print)
        client = docker_client()
        assert client.containers.list(all=True, filters={"label": f"{PROJECT_LABEL}={PROJECT}"}) == []


def test_the_plan_applies_loss_with_iptables_statistic(lossy_pair):
    _, plan, _ = lossy_pair
    assert plan.mechanisms == {"loss": STATISTIC} and plan.unsupported == ()
    assert plan.applied.loss_pct == LOSS_PCT


def test_drops_are_counted_and_tcp_still_delivers_every_byte(lossy_pair):
    by_role, _, _ = lossy_pair
    coordinator, worker = by_role["coordinator"], by_role["worker"]
    before = read_fallback_counters(ContainerExec(coordinator))
    received = transfer(worker, coordinator, "coordinator", TRANSFER_BYTES)  # lossy: the coordinator receives
    after = read_fallback_counters(ContainerExec(coordinator))
    seen = after["seen_packets"] - before["seen_packets"]
    dropped = after["dropped_packets"] - before["dropped_packets"]
    print(f"loss {LOSS_PCT:g} % asked: {dropped} of {seen} packets dropped ({100 * dropped / seen:.2f} %)")
    assert received == TRANSFER_BYTES  # TCP retransmitted every dropped segment
    assert dropped > 0
    assert 100 * dropped / seen < 3 * LOSS_PCT  # a mechanism check, not a fidelity figure


def test_reset_leaves_no_rule_and_no_qdisc(lossy_pair):
    by_role, _, default_qdiscs = lossy_pair
    runner = ContainerExec(by_role["coordinator"])
    assert fallback_rules(runner) != []  # the rules are in force until the reset
    reset_links(runner)
    assert fallback_rules(runner) == []
    assert qdisc_kinds(runner) == default_qdiscs


DELAY_MS = 20.0
# The names of the container's processes, from /proc (the node image has no ps).
PROCESSES = """
import json, os
names = []
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        names.append(os.path.basename(open(f"/proc/{pid}/cmdline", "rb").read().split(b"\\0")[0].decode()))
    except OSError:
        pass
print(json.dumps(names))
"""


def processes(container) -> list[str]:
    code, out = container.exec_run(["python", "-c", PROCESSES])
    assert code == 0, out
    return json.loads(out)


def round_trips(by_role) -> dict:
    return rtt.summarize(rtt.measure_rtt(by_role["coordinator"], by_role["worker"], "coordinator", 40))


@pytest.fixture
def delayed_coordinator(lossy_pair):
    """The pair's coordinator with DELAY_MS on its arrivals through the delay line (no loss): its plan."""
    by_role, _, _ = lossy_pair
    runner = ContainerExec(by_role["coordinator"])
    reset_links(runner)
    caps = probe_capabilities(docker_client(), image())
    assert caps.nfqueue, f"the node image or kernel has no delay line: {caps.errors}"
    plan = plan_shaping(LinkProfile(delay_ms=DELAY_MS), dataclasses.replace(caps, netem=False))
    apply_plan(runner, plan)
    yield plan
    reset_links(runner)


def test_the_delay_line_holds_the_round_trip_and_leaves_nothing_after_it(lossy_pair, delayed_coordinator):
    by_role, _, default_qdiscs = lossy_pair
    coordinator = by_role["coordinator"]
    runner = ContainerExec(coordinator)
    assert delayed_coordinator.mechanisms == {"delay": DELAY_LINE_MECHANISM}
    delayed = round_trips(by_role)
    deadline = time.monotonic() + 2.0  # the stats file is rewritten every 250 ms: wait for a current one
    while (stats := read_delay_line_stats(runner))["accepted_packets"] < 40 and time.monotonic() < deadline:
        time.sleep(0.1)
    print(f"delay {DELAY_MS:g} ms asked: {delayed}, delay line {stats}")
    assert delayed["min_rtt_ms"] >= DELAY_MS  # every round trip waited out the delay (a lower bound, no window)
    assert stats["running"] and stats["accepted_packets"] >= 40 and stats["delay_us"] == DELAY_MS * 1000
    assert stats["early_max_us"] == 0  # never a packet before its due time
    assert 0 < stats["late_p99_us"] <= stats["late_max_us"]  # the histogram's p99, capped by the latest
    assert "wiiide-delayline" in processes(coordinator)
    reset_links(runner)
    assert "wiiide-delayline" not in processes(coordinator)
    assert fallback_rules(runner) == [] and qdisc_kinds(runner) == default_qdiscs
    bound = runner.run(["cat", "/proc/net/netfilter/nfnetlink_queue"])
    assert bound.strip() == ""  # no queue bound any more in the container's namespace
    assert round_trips(by_role)["median_rtt_ms"] < DELAY_MS / 2  # and the link is as fast as before


def test_a_killed_delay_line_does_not_blackhole_the_container(lossy_pair, delayed_coordinator):
    by_role, _, _ = lossy_pair
    coordinator = by_role["coordinator"]
    pid = read_delay_line_stats(ContainerExec(coordinator))["pid"]
    code, out = coordinator.exec_run(["python", "-c", "import os, sys; os.kill(int(sys.argv[1]), 9)", str(pid)])
    assert code == 0, out
    assert fallback_rules(ContainerExec(coordinator)) != []  # the NFQUEUE rule is still in the path
    assert round_trips(by_role)["median_rtt_ms"] < DELAY_MS / 2  # --queue-bypass: through, undelayed
