"""Docker tests of netem's reorder, duplicate and Gilbert-Elliott loss where the kernel has no netem
(the delay line, iptables TEE), and of a link per pair with delay applied through the fallback matched
on the peer's address: on a cluster held at the start gate, each impairment acts (the receiver sees
copies, overtakers and losses; the mechanisms count them), only the shaped pair is delayed, and a reset
leaves no rule, no bound queue and no delay line process.

Fidelity (how close the counts come to what was asked) is `bench-link --measure
reorder,duplicate,gemodel`'s figure, not a pass/fail here."""

from __future__ import annotations

import dataclasses
import json
import threading

import pytest

from harness.bench.link_udp import PORT, RECEIVE_ORDER, SEND
from harness.links import rtt
from harness.links.fidelity import arrival_stats
from harness.links.pairs import pair_reset_commands, plan_pairs
from harness.links.plan import plan_shaping
from harness.run.compose_file import PROJECT_LABEL
from harness.run.compose_project import PROJECT, cluster_down, cluster_up
from harness.run.docker_client import docker_client
from harness.run.pair_shaping import node_ips, read_pair_fallback, shape_pairs
from harness.run.shaping import START_GATE_FILE, container_identity
from harness.run.tc_exec import (ContainerExec, apply_plan, probe_capabilities, read_delay_line_stats,
                                 read_fallback_counters, reset_links)
from harness.spec.links import LinkProfile
from harness.spec.pairs import PairEntry, Topology
from tests.docker.test_links_fallback import image, processes
from wiiide.config import RunConfig

pytestmark = pytest.mark.docker

DATAGRAMS = 5000
PROFILE = {"delay": "5ms", "reorder": "25%", "duplicate": "5%", "loss_gemodel": {"p": "2%", "r": "30%"}}
PAIR_DELAY_MS = 10.0
RTT_PROBES = 30


def leftovers(container) -> dict:
    """What the fallback could leave in a container: its iptables rules (mangle), bound queues and
    delay line processes."""
    runner = ContainerExec(container)
    rules = [line for line in runner.run(["iptables", "-w", "-t", "mangle", "-S"]).splitlines() if "WIIIIIDE" in line]
    queues = runner.run(["cat", "/proc/net/netfilter/nfnetlink_queue"]).strip()
    return {"rules": rules, "queues": queues, "delay_lines": [p for p in processes(container) if p == "wiiide-delayline"]}


@pytest.fixture(scope="module")
def cluster(docker_ready, tmp_path_factory):
    """A coordinator and two workers held at the start gate (no training traffic), by node name, with
    the kernel's probed capabilities (netem taken as absent)."""
    cfg = RunConfig(num_workers=2, duration_s=60, connect_timeout_s=120, start_gate_file=START_GATE_FILE,
                    log_tier="silent")
    containers = cluster_up(cfg, tmp_path_factory.mktemp("impair-cluster"), image())
    try:
        caps = dataclasses.replace(probe_capabilities(docker_client(), image()), netem=False)
        assert caps.nfqueue and caps.tee and caps.statistic, f"no delay line or TEE here: {caps.errors}"
        names = {("coordinator" if role == "coordinator" else f"worker-{i}"): c
                 for c in containers for role, i in [container_identity(c)]}
        yield names, caps, containers
    finally:
        cluster_down(print)
        assert docker_client().containers.list(all=True, filters={"label": f"{PROJECT_LABEL}={PROJECT}"}) == []


def send_numbered(sender, receiver, receiver_host: str, count: int) -> list[int]:
    result = {}
    thread = threading.Thread(target=lambda: result.update(
        exec=receiver.exec_run(["python", "-c", RECEIVE_ORDER, str(PORT)], demux=True)))
    thread.start()
    code, out = sender.exec_run(["python", "-c", "import time; time.sleep(0.5)\n" + SEND, receiver_host, str(PORT),
                                 str(count)])
    thread.join(timeout=120)
    assert code == 0, out
    code, (out, err) = result["exec"]
    assert code == 0, err
    return json.loads(out)


def test_reorder_duplicate_and_burst_loss_apply_are_counted_and_leave_nothing(cluster):
    names, caps, _ = cluster
    coordinator = names["coordinator"]
    runner = ContainerExec(coordinator)
    before = leftovers(coordinator)
    plan = plan_shaping(LinkProfile.from_mapping(PROFILE), caps)
    assert plan.mechanisms == {"delay": "delay-line", "reorder": "delay-line", "loss_gemodel": "delay-line",
                               "duplicate": "iptables-tee"} and plan.unsupported == ()
    apply_plan(runner, plan)
    try:
        seen = arrival_stats(send_numbered(names["worker-1"], coordinator, "coordinator", DATAGRAMS), DATAGRAMS)
        line = read_delay_line_stats(runner)
        tee = read_fallback_counters(runner, None, "WIIIIIDE-DUP")["duplicate"]
    finally:
        reset_links(runner)
    print(f"receiver {seen}; delay line {line}; tee {tee}")
    assert seen["duplicates"] > 0 and tee["duplicated_packets"] > 0  # copies reached the socket
    assert seen["early_datagrams"] > 0 and line["reordered_packets"] > 0  # some overtook the delayed ones
    assert seen["lost_datagrams"] > 0 and line["loss_dropped_packets"] > 0 and line["gemodel"]
    assert line["loss_bursts"] < line["loss_dropped_packets"]  # losses came in runs (mean 1 / r = 3.3)
    assert leftovers(coordinator) == before == {"rules": [], "queues": "", "delay_lines": []}


def test_a_pair_link_with_delay_delays_that_pair_alone_and_leaves_nothing(cluster):
    names, caps, containers = cluster
    topology = Topology(pairs=(PairEntry(nodes=("coordinator", "worker-1"),
                                         profile=LinkProfile(delay_ms=PAIR_DELAY_MS, loss_pct=0.5)),))
    ips = node_ips(containers, container_identity)
    plans, pairs = {}, {}
    for node in ("coordinator", "worker-1"):
        plans[node] = plan_pairs(topology, node, 2, caps)
        assert plans[node].classes[0].mechanisms == {"delay": "delay-line", "loss": "iptables-statistic"}
        shape_pairs(ContainerExec(names[node]), plans[node], ips, {}, pairs)
    try:
        seen_before = pairs["coordinator->worker-1"]["fallback_counters"]["seen_packets"]
        slow = rtt.summarize(rtt.measure_rtt(names["coordinator"], names["worker-1"], "coordinator", RTT_PROBES))
        fast = rtt.summarize(rtt.measure_rtt(names["coordinator"], names["worker-2"], "coordinator", RTT_PROBES))
        read_pair_fallback(ContainerExec(names["coordinator"]), plans["coordinator"], pairs)  # counts after the probes
        shape_pairs_again = pairs["coordinator->worker-1"]
    finally:
        for node, plan in plans.items():
            runner = ContainerExec(names[node])
            for argv in [*pair_reset_commands(plan, ips), ["tc", "qdisc", "del", "dev", "eth0", "root"]]:
                try:
                    runner.run(argv)
                except Exception:
                    pass  # nothing of that kind to remove
    print(f"pair with {PAIR_DELAY_MS:g} ms each way: {slow}; unshaped pair: {fast}; record {shape_pairs_again}")
    assert slow["min_rtt_ms"] >= 2 * PAIR_DELAY_MS  # both ends delay what arrives from the other
    assert fast["median_rtt_ms"] < PAIR_DELAY_MS / 2  # the other pair is not delayed
    record = shape_pairs_again
    assert record["mechanisms"] == {"delay": "delay-line", "loss": "iptables-statistic"}
    assert record["delay_line"]["running"] and record["delay_line"]["queue"] == 0x11
    # the pair's loss chain saw the probes to worker-1 (a probe it drops is seen too; the reply of a probe
    # worker-1's chain dropped is not: 0.5 % each way leaves nearly all of them)
    assert record["fallback_counters"]["seen_packets"] - seen_before >= RTT_PROBES // 2
    for node in ("coordinator", "worker-1"):
        assert leftovers(names[node]) == {"rules": [], "queues": "", "delay_lines": []}
