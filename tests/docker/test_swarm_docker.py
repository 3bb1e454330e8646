"""Docker tests of the swarm backend on a single-node swarm: a shaped point runs end to end as a stack
and reads its rate back, faults the backend cannot inject are refused before the engine is touched, a
failed deploy and `up`/`down` clean up; after every test nothing of the project's stack is left and a
swarm the harness started has been left again (an engine already in a swarm stays in it)."""

from __future__ import annotations

import os

import pytest

from harness.errors import ClusterError
from harness.results.report import (
    load_report_json as load_report,  # the report as its JSON object
)
from harness.run.docker_client import docker_client
from harness.run.image import DEFAULT_TAG
from harness.spec.points import build_spec
from harness.sweep import run_sweep
from wiiide.config import RunConfig

pytestmark = pytest.mark.docker

IMAGE = os.environ.get("WIIIIIDE_IMAGE", DEFAULT_TAG)
RATE_BPS = 100_000_000


@pytest.fixture(scope="module")
def image(docker_ready):
    from harness.run.image import build_image
    return build_image(IMAGE, log=lambda line: None)


@pytest.fixture(autouse=True)
def leaves_nothing(docker_ready):
    """Before: the engine's swarm state. After: no service, container, network, secret or config of the
    stack, and the engine in the swarm state it had (a swarm the harness started is gone, with its
    docker_gwbridge). Without an engine, `docker_ready` fails the test with the reason (required) and
    the docker marker skips it (not required)."""
    from harness.run.swarm.cluster import swarm_info
    from harness.run.swarm.stack import object_name, stack_name, stack_objects
    client = docker_client()
    before = swarm_info(client).get("LocalNodeState")
    gwbridge_before = bool(client.networks.list(names=["docker_gwbridge"]))
    yield
    after = swarm_info(client).get("LocalNodeState")
    if after == "active":
        left = {k: [object_name(o) for o in v] for k, v in stack_objects(client, stack_name()).items() if v}
        assert not left, f"left behind: {left}"
    assert after == before, f"swarm state {before} before the test, {after} after"
    assert bool(client.networks.list(names=["docker_gwbridge"])) == gwbridge_before


def test_shaped_point_runs_as_a_stack_and_reads_back_its_rate(image, tmp_path, monkeypatch):
    from harness.run.swarm.tasks import COPY_METRICS_ENV
    monkeypatch.setenv(COPY_METRICS_ENV, "1")  # metrics through the Engine API, as from another host
    spec = build_spec({
        "name": "swarm-tiny", "repeats": 1, "link_presets": {"rate-100m": {"rate": "100mbit"}},
        "base": {"dataset": "digits", "num_workers": 2, "duration_s": 4, "log_tier": "normal",
                 "log_every_steps": 1000, "link": "rate-100m"},
        "faults": [{"action": "pause", "target": "worker-2", "at_s": 1, "duration_s": 1}],
        "axes": {"compression": ["none"]},
    }, "swarm-tiny.yaml")
    report = load_report(run_sweep(spec, "swarm", tmp_path, progress=print))
    assert report["backend"]["name"] == "swarm"
    assert report["backend"]["stack"].endswith("-stack")
    rep = report["points"][0]["repeats"][0]
    assert rep["status"] == "ok", rep["error"]
    assert sorted(c["role"] for c in rep["containers"].values()) == ["coordinator", "worker", "worker"]
    for name, c in rep["containers"].items():
        assert c["exit_code"] == 0, name
        assert c["node"] and c["node_id"], name  # the swarm node that ran the task
        assert c["summary"]["net_rx_bytes"] > 0, name
        assert c["metrics_via"] == "archive copy", name
    shaped = rep["links"]["containers"]
    assert len(shaped) == 3
    for name, link in shaped.items():
        assert link["applied_rate_bps"] == RATE_BPS, name  # tc -j read-back inside the task
        assert link["counter_reads"] >= 1, name
    assert [(f["action"], f["target"], f["ok"]) for f in rep["faults"]] == [
        ("pause", "worker-2", True), ("resume", "worker-2", True)]
    workers = [n for name, n in rep["nodes"].items() if name.startswith("worker")]
    assert sorted(w["rank"] for w in workers) == [1, 2]  # ranks from the coordinator, no container_name
    assert sum(w["batches"] for w in workers) == rep["nodes"]["coordinator"]["batches"] > 0


def test_restart_fault_is_refused_before_the_swarm_is_touched(image, tmp_path):
    spec = build_spec({"name": "swarm-restart", "base": {"num_workers": 2, "duration_s": 2},
                       "faults": [{"action": "kill", "target": "worker-1", "at_s": 1},
                                  {"action": "restart", "target": "worker-1", "at_s": 2}],
                       "axes": {"compression": ["none"]}}, "swarm-restart.yaml")
    with pytest.raises(ClusterError, match="cannot restart"):
        run_sweep(spec, "swarm", tmp_path, progress=print)
    assert not list(tmp_path.iterdir())  # refused before any folder, stack or swarm


def test_failed_deploy_removes_the_stack(image, tmp_path):
    from harness.run.loop import run_point
    from harness.run.swarm import SwarmBackend
    backend = SwarmBackend(image_tag="wiiide-no-such-image:never", progress=print)
    try:
        result = run_point(backend, RunConfig(num_workers=1, duration_s=2), tmp_path, 60, print)
    finally:
        backend.close(print)
    assert result.status == "failed"
    assert "a task failed before it ran" in result.error and "No such image: wiiide-no-such-image" in result.error


def test_up_then_down_leaves_nothing(image, tmp_path):
    """`up --backend swarm` (launch, then the process ends with the stack running), then `down`."""
    from harness.run import swarm
    from harness.spec.cluster import ClusterSettings
    backend = swarm.SwarmBackend(IMAGE, print)
    containers = backend.launch(RunConfig(num_workers=2, duration_s=60), tmp_path, ClusterSettings(), print)
    assert [(c.service, c.slot) for c in containers] == [("coordinator", 1), ("worker", 1), ("worker", 2)]
    assert {c.labels["com.docker.swarm.service.name"] for c in containers} == {
        f"{swarm.stack_name()}_coordinator", f"{swarm.stack_name()}_worker"}
    assert all(c.status == "running" for c in containers)
    swarm.cluster_down(print)


def test_encrypted_overlay_is_created_and_its_iptables_rules_removed(image, tmp_path):
    """``overlay_encrypted``: the stack's network carries the ``encrypted`` option; after teardown the
    port-4789 iptables rules libnetwork added for it (Engine < 24 leaves them) are gone again."""
    from harness.run import swarm
    from harness.run.swarm.encryption import _save, vxlan_rules
    from harness.run.swarm.stack import STACK_LABEL
    from harness.spec.cluster import ClusterSettings
    try:
        rules_before = vxlan_rules(_save())
    except OSError:  # not root, or the engine on another host: the network is still checked
        rules_before = None
    backend = swarm.SwarmBackend(IMAGE, print)
    try:
        backend.launch(RunConfig(num_workers=1, duration_s=30), tmp_path, ClusterSettings(overlay_encrypted=True), print)
        (network,) = backend.client.networks.list(filters={"label": f"{STACK_LABEL}={backend.stack}"})
        network.reload()
        assert network.attrs["Driver"] == "overlay" and "encrypted" in network.attrs["Options"]
    finally:
        backend.close(print)
    if rules_before is not None:
        assert vxlan_rules(_save()) == rules_before
