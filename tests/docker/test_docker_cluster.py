"""Docker tests: a 2-worker point in real containers, and cluster up/down leaving nothing behind."""

from __future__ import annotations

import pytest

from harness.results.report import (
    load_report_json as load_report,  # the report as its JSON object
)
from harness.spec.points import build_spec
from harness.sweep import run_sweep

pytestmark = pytest.mark.docker


@pytest.fixture(scope="module")
def docker_report(docker_ready, tmp_path_factory):
    spec = build_spec({
        "name": "docker-tiny", "repeats": 1,
        "base": {"dataset": "digits", "num_workers": 2, "duration_s": 8, "log_tier": "normal",
                 "log_every_steps": 1000},
        "axes": {"compression": ["none"]},
    }, "docker-tiny.yaml")
    path = run_sweep(spec, "docker", tmp_path_factory.mktemp("results"), progress=print)
    return load_report(path)


def test_point_runs_in_containers(docker_report):
    assert docker_report["backend"]["name"] == "docker"
    point = docker_report["points"][0]
    assert point["status"] == "ok", point["error"]
    rep = point["repeats"][0]
    roles = sorted(c["role"] for c in rep["containers"].values())
    assert roles == ["coordinator", "worker", "worker"]
    for name, container in rep["containers"].items():
        assert container["exit_code"] == 0, name
        summary = container["summary"]
        assert summary["sample_count"] >= 1, name
        assert summary["net_rx_bytes"] > 0 and summary["net_tx_bytes"] > 0, name
        assert summary["memory_peak_bytes"] > 10_000_000, name  # torch alone is far more than 10 MB


def test_batches_add_up_and_accuracy_beats_chance(docker_report):
    rep = docker_report["points"][0]["repeats"][0]
    coord = rep["nodes"]["coordinator"]
    workers = [n for name, n in rep["nodes"].items() if name.startswith("worker")]
    assert len(workers) == 2
    assert sum(w["batches"] for w in workers) == coord["batches"] > 0
    assert sorted(coord["batches_per_worker"].values()) == sorted(w["batches"] for w in workers)
    assert rep["totals"]["test_accuracy"] > 0.8  # 10 classes: chance is 0.1
    # every node saw its own interface traffic, and the coordinator's socket options were read back
    assert all(n["iface_bytes_recv"] > 0 for n in rep["nodes"].values())
    # socket(7): the kernel caps an SO_SNDBUF/SO_RCVBUF request at net.core.wmem_max/rmem_max (the host's:
    # not namespaced) and doubles it; the default request is 8 MiB
    machine = docker_report["machine_info"]
    for opts in coord["socket_options"]:
        assert opts["sndbuf_requested_bytes"] == opts["rcvbuf_requested_bytes"] == 8 * 1024 * 1024
        assert opts["sndbuf_bytes"] == 2 * min(opts["sndbuf_requested_bytes"], machine["wmem_max_bytes"])
        assert opts["rcvbuf_bytes"] == 2 * min(opts["rcvbuf_requested_bytes"], machine["rmem_max_bytes"])


def test_cluster_up_then_down_leaves_nothing(docker_ready):
    from harness import REPO_ROOT
    from harness.run.compose_file import PROJECT_LABEL
    from harness.run.compose_project import PROJECT, cluster_down, cluster_up
    from harness.run.docker_client import docker_client
    from wiiide.config import RunConfig

    client = docker_client()
    try:
        containers = cluster_up(RunConfig(num_workers=4, duration_s=60), (REPO_ROOT / "results" / "cluster-test").resolve())
        assert len(containers) == 5
        assert len(client.networks.list(filters={"label": f"{PROJECT_LABEL}={PROJECT}"})) == 1
    finally:
        cluster_down(print)
    assert client.containers.list(all=True, filters={"label": f"{PROJECT_LABEL}={PROJECT}"}) == []
    assert client.networks.list(filters={"label": f"{PROJECT_LABEL}={PROJECT}"}) == []
