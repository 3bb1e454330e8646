"""Docker tests of links by pair and of links that change while training: on a coordinator and two
workers held at the start gate, a pair link (coordinator <-> worker-2, its own htb class and u32 filter
on each end) is applied, read back (class rate, filter address) and carries the pair's traffic while the
other pair goes through its own class; a schedule step changes the pair's rate, and the change is
recorded and read back; a reset leaves no class, filter or qdisc. A sweep point with a schedule on
every container records its changes in the report, and after it no container, network or ifb is left."""

from __future__ import annotations

import json
import time

import pytest

from harness.results.report import load_report_json as load_report
from harness.run.compose_file import PROJECT_LABEL
from harness.run.compose_project import PROJECT, cluster_down, cluster_up
from harness.run.docker_client import docker_client
from harness.run.shaping import START_GATE_FILE, ClusterConditions, container_identity
from harness.run.tc_exec import ContainerExec, probe_capabilities, read_back, reset_links
from harness.spec.points import build_spec
from harness.sweep import run_sweep
from tests.docker.test_links import bulk_transfer, host_ifbs
from tests.docker.test_links_fallback import image
from wiiide.config import RunConfig

pytestmark = pytest.mark.docker

PAIR_LINK = {"pairs": [{"between": ["coordinator", "worker-2"],
                        "profile": {"schedule": [{"at": "0s", "rate": "50mbit"}, {"at": "1s", "rate": "20mbit"}]}}],
             "default": {"rate": "500mbit"}}


def wait_for(predicate, timeout_s: float = 30.0) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.1)
    return predicate()


def class_sent_bytes(runner: ContainerExec, classid: str) -> int:
    records = read_back(runner, ["eth0"])["eth0"]
    return next(r["sent_bytes"] for r in records if r.get("type") == "class" and r.get("handle") == classid)


@pytest.fixture(scope="module")
def pair_cluster(docker_ready, tmp_path_factory):
    """Three containers held at the gate, shaped by pair through `ClusterConditions` (as a run does)."""
    ifbs_before = host_ifbs()
    spec = build_spec({"name": "pairs", "base": {"num_workers": 2, "link": PAIR_LINK}}, "pairs.yaml")
    cfg = RunConfig(num_workers=2, duration_s=60, connect_timeout_s=120, start_gate_file=START_GATE_FILE,
                    log_tier="silent")
    containers = cluster_up(cfg, tmp_path_factory.mktemp("pairs-cluster"), image())
    conditions = ClusterConditions(spec.points[0].cluster, lambda: probe_capabilities(docker_client(), image()))
    try:
        conditions.plan(2)
        t0 = time.monotonic()
        conditions.apply(containers, t0, print)
        by_node = {("coordinator" if r == "coordinator" else f"worker-{i}"): c
                   for c in containers for r, i in [container_identity(c)]}
        yield conditions, by_node
    finally:
        conditions.stop()
        cluster_down(print)
        client = docker_client()
        assert client.containers.list(all=True, filters={"label": f"{PROJECT_LABEL}={PROJECT}"}) == []
        assert client.networks.list(filters={"label": f"{PROJECT_LABEL}={PROJECT}"}) == []
        assert host_ifbs() == ifbs_before


def test_each_pair_has_its_class_and_filter_read_back(pair_cluster):
    conditions, _ = pair_cluster
    pairs = conditions.links["pairs"]
    assert set(pairs) == {f"{a}->{b}" for a in ("coordinator", "worker-1", "worker-2")
                          for b in ("coordinator", "worker-1", "worker-2") if a != b}
    assert pairs["coordinator->worker-2"]["rate_bps"] == 50_000_000 and pairs["worker-2->coordinator"]["rate_bps"] == 50_000_000
    assert pairs["coordinator->worker-1"]["rate_bps"] == 500_000_000 and pairs["coordinator->worker-1"]["link"] == "default"
    assert all(p["filter_ok"] for p in pairs.values()), pairs


def test_the_pairs_traffic_goes_through_its_own_class(pair_cluster):
    _, by_node = pair_cluster
    coordinator = ContainerExec(by_node["coordinator"])
    before = {cid: class_sent_bytes(coordinator, cid) for cid in ("1:11", "1:12")}
    to_slow = bulk_transfer(by_node["coordinator"], by_node["worker-2"], by_node["worker-2"].name)
    to_fast = bulk_transfer(by_node["coordinator"], by_node["worker-1"], by_node["worker-1"].name)
    after = {cid: class_sent_bytes(coordinator, cid) for cid in ("1:11", "1:12")}
    print(f"coordinator->worker-2 {to_slow['bytes'] * 8 / to_slow['seconds'] / 1e6:.1f} Mbit/s, "
          f"->worker-1 {to_fast['bytes'] * 8 / to_fast['seconds'] / 1e6:.1f} Mbit/s")
    assert after["1:12"] - before["1:12"] >= to_slow["bytes"]  # worker-2's bytes went through its class
    assert after["1:11"] - before["1:11"] >= to_fast["bytes"]
    assert after["1:12"] - before["1:12"] < to_fast["bytes"] + to_slow["bytes"]  # not worker-1's too


def test_a_schedule_step_changes_the_pair_and_is_read_back(pair_cluster):
    conditions, by_node = pair_cluster
    changes = conditions.links["pairs"]["coordinator->worker-2"]["timeline_changes"]
    conditions.timeline.start(time.monotonic())
    assert wait_for(lambda: len(changes) == 1), changes
    [change] = changes
    assert change["changes"] == {"rate_bps": 20_000_000} and "error" not in change, change
    assert change["read_back_rate_bps"] == 20_000_000 and change["applied_at_s"] >= change["at_s"]
    records = read_back(ContainerExec(by_node["worker-2"]), ["eth0"])["eth0"]
    assert next(r["rate_bps"] for r in records if r.get("handle") == "1:10") == 20_000_000  # the other end too


def test_a_reset_leaves_no_class_filter_or_qdisc(pair_cluster):
    _, by_node = pair_cluster
    runner = ContainerExec(by_node["worker-1"])
    assert json.loads(runner.run(["tc", "-j", "filter", "show", "dev", "eth0"])) != []
    reset_links(runner)
    assert json.loads(runner.run(["tc", "-j", "filter", "show", "dev", "eth0"])) == []
    assert runner.run(["tc", "class", "show", "dev", "eth0"]).strip() == ""
    assert [q["kind"] for q in json.loads(runner.run(["tc", "-j", "qdisc", "show", "dev", "eth0"]))] == ["noqueue"]


def test_a_sweep_point_records_each_schedule_change(docker_ready, tmp_path):
    ifbs_before = host_ifbs()
    spec = build_spec({
        "name": "links-schedule", "repeats": 1,
        "base": {"dataset": "digits", "num_workers": 1, "duration_s": 5, "log_every_steps": 1000,
                 "link": {"schedule": [{"at": "0s", "rate": "200mbit"}, {"at": "2s", "rate": "100mbit"}]}},
    }, "links-schedule.yaml")
    report = load_report(run_sweep(spec, "docker", tmp_path, progress=print))
    point = report["points"][0]
    assert point["status"] == "ok", point["error"]
    assert point["cluster"]["link"]["profiles"]["all"]["timeline"]["changes"] == 1
    for record in point["repeats"][0]["links"]["containers"].values():
        [change] = record["timeline_changes"]
        assert change["changes"] == {"rate_bps": 100_000_000} and change["read_back_rate_bps"] == 100_000_000
    client = docker_client()
    assert client.containers.list(all=True, filters={"label": f"{PROJECT_LABEL}={PROJECT}"}) == []
    assert host_ifbs() == ifbs_before
