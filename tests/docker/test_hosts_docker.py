"""Docker test of several hosts on one machine (harness.hosts): two hosts with their own dockerd in one
swarm, the node image pulled from the registry beside them, a 2-worker point across both (a task on
each host, on an overlay of MTU 1450), and nothing of the hosts left on the engine afterwards, also
after an `up` that failed half-way. About 3-4 min, most of it pushing and pulling the 1.3 GB image."""

from __future__ import annotations

import os

import pytest

from harness.errors import ClusterError
from harness.results.report import load_report_json as load_report
from harness.run.image import DEFAULT_TAG
from harness.spec.points import build_spec
from harness.sweep import run_sweep

pytestmark = pytest.mark.docker

IMAGE = os.environ.get("WIIIIIDE_IMAGE", DEFAULT_TAG)


def _nothing_left():
    from harness.hosts.engines import leftovers
    from harness.hosts.plan import HostsPlan
    from harness.run.compose_project import PROJECT
    assert leftovers() == {}
    assert not (HostsPlan(PROJECT, 1).socket_root / PROJECT).exists()


@pytest.fixture
def cleans_up(docker_ready):
    from harness.hosts.engines import hosts_down
    yield
    try:
        _nothing_left()
    finally:
        hosts_down(lambda line: None)


def test_a_failed_up_removes_what_it_made(cleans_up, monkeypatch):
    import harness.hosts.engines as engines

    def fail(*args, **kwargs):
        raise ClusterError("swarm refused (test)")
    monkeypatch.setattr(engines, "_form_swarm", fail)
    with pytest.raises(ClusterError, match="swarm refused"):
        engines.hosts_up(2, lambda line: None)
    _nothing_left()


def test_a_point_runs_across_two_hosts_and_down_leaves_nothing(cleans_up, tmp_path, monkeypatch):
    from harness.hosts.engines import hosts_down, hosts_up
    from harness.hosts.plan import HOSTS_ENV
    from harness.run.image import build_image

    build_image(IMAGE, log=lambda line: None)
    hosts = hosts_up(2, print, node_image=IMAGE)
    monkeypatch.setenv(HOSTS_ENV, "1")
    spec = build_spec({
        "name": "hosts-tiny", "repeats": 1,
        "base": {"dataset": "digits", "num_workers": 2, "duration_s": 2, "log_tier": "normal",
                 "log_every_steps": 1000},
        "axes": {"compression": ["none"]},
    }, "hosts-tiny.yaml")
    report = load_report(run_sweep(spec, "swarm", tmp_path, progress=print))
    assert report["backend"]["hosts"] == list(hosts.urls)
    assert report["backend"]["image"] == hosts.plan.image_in_registry(IMAGE)  # pulled from the registry
    rep = report["points"][0]["repeats"][0]
    assert rep["status"] == "ok", rep["error"]
    workers = {n: c for n, c in rep["containers"].items() if c["role"] == "worker"}
    assert sorted(c["node"] for c in workers.values()) == sorted(hosts.urls)  # one worker on each host
    for name, c in rep["containers"].items():
        assert c["exit_code"] == 0, name
        assert c["overlay_mtu_bytes"] == 1450, name  # 1500 on the hosts' network, less VXLAN's 50
        assert c["metrics_via"] == "archive copy", name
    assert rep["totals"]["throughput_samples_per_s"] > 0
    hosts_down(print)
    _nothing_left()
