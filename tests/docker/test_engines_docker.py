"""Docker test: one DDP point in the same containers as WIIIIIDE (coordinator = rank 0, gloo on eth0), with
the bytes on the containers' interfaces set against the ring all-reduce formula."""

from __future__ import annotations

import pytest

from harness.results.report import (
    load_report_json as load_report,  # the report as its JSON object
)
from harness.spec.points import build_spec
from harness.sweep import run_sweep

pytestmark = pytest.mark.docker


@pytest.fixture(scope="module")
def ddp_report(docker_ready, tmp_path_factory):
    spec = build_spec({
        "name": "docker-ddp", "repeats": 1,
        "base": {"dataset": "digits", "hidden_sizes": [512, 512], "num_workers": 2, "max_steps": 30,
                 "duration_s": 120, "log_tier": "normal"},
        "axes": {"engine": ["ddp"]},
    }, "docker-ddp.yaml")
    path = run_sweep(spec, "docker", tmp_path_factory.mktemp("results"), progress=print)
    return load_report(path)


def test_ddp_point_runs_in_the_wiiide_containers(ddp_report):
    point = ddp_report["points"][0]
    assert point["status"] == "ok", point["error"]
    rep = point["repeats"][0]
    assert sorted(c["role"] for c in rep["containers"].values()) == ["coordinator", "worker", "worker"]
    assert all(c["exit_code"] == 0 for c in rep["containers"].values())
    nodes = rep["nodes"]
    assert sorted(n["rank"] for n in nodes.values()) == [0, 1, 2]
    assert all(n["engine"] == "ddp" and n["gloo_socket_ifname"] == "eth0" for n in nodes.values())
    assert all(n["training_summary"]["num_steps"] == 20 for n in nodes.values())
    assert rep["totals"]["test_accuracy"] > 0.5  # 10 classes: chance is 0.1


def test_interface_bytes_match_the_ring_all_reduce(ddp_report):
    totals = ddp_report["points"][0]["repeats"][0]["totals"]
    # 301,066 parameters, 3 ranks: 2 (W-1) x 1.2 MB = 4.8 MB sent per step over all nodes
    assert totals["comm_expected_bytes_per_step"] == pytest.approx(4 * 301_066 * 4, rel=1e-9)
    # measured on the containers' own interfaces: the formula plus setup, headers and the stop checks
    assert 0.95 <= totals["comm_measured_over_expected"] <= 1.3
    assert 0.0 < totals["comm_share"] <= 1.0
