"""Warm containers (`ComposeBackend(reuse=True)`): the runs of one cluster share containers, each with
fresh node processes, its own metrics and its own byte counts; a fault or a different cluster makes
fresh ones; `close` leaves nothing behind."""

from __future__ import annotations

import pytest

from harness.run.compose import ComposeBackend
from harness.run.compose_project import project_containers
from harness.run.loop import run_point
from harness.run.stats import read_counters
from harness.spec.faults import Fault
from wiiide.config import RunConfig

pytestmark = pytest.mark.docker
FAST = {"dataset": "digits", "log_tier": "normal", "log_every_steps": 100000, "io_timeout_s": 3.0,
        "heartbeat_interval_s": 0.5, "duration_s": 2.0, "connect_timeout_s": 180.0}  # a loaded shared machine


def test_runs_share_warm_containers_until_a_fault_and_close_removes_them(docker_ready, tmp_path):
    backend = ComposeBackend(reuse=True)
    cfg = RunConfig.from_dict({**FAST, "num_workers": 2})
    try:
        first = run_point(backend, cfg, tmp_path / "point" / "r0", progress=print)
        assert first.status == "ok", first.error
        assert not backend.last_run_reused and "create" in first.phases_s
        ids = sorted(c.id for c in project_containers())
        second = run_point(backend, cfg.replace(sndbuf_bytes=1 << 20), tmp_path / "point" / "r1", progress=print)
        assert second.status == "ok", second.error
        assert backend.last_run_reused and sorted(c.id for c in project_containers()) == ids
        # the run's own config reached its fresh node processes
        assert {o["sndbuf_requested_bytes"] for o in second.nodes["coordinator"]["socket_options"]} == {1 << 20}
        assert {o["sndbuf_requested_bytes"] for o in first.nodes["coordinator"]["socket_options"]} == {8 << 20}
        assert first.nodes["coordinator"]["pid"] != second.nodes["coordinator"]["pid"]
        assert (tmp_path / "point" / "r1" / "logs").is_dir()
        coordinator = next(name for name in second.containers if "coordinator" in name)
        # this run's bytes only: less than the container has received since it was created
        run_rx = second.containers[coordinator]["summary"]["net_rx_bytes"]
        total_rx = read_counters(next(c for c in project_containers() if c.name == coordinator))["net_rx_bytes"]
        assert 0 < run_rx < total_rx
        assert second.containers[coordinator]["started_at_utc"] > first.containers[coordinator]["finished_at_utc"]

        third = run_point(backend, cfg, tmp_path / "point" / "r2", progress=print,
                          faults=[Fault.model_validate({"action": "kill", "target": "worker-1", "at_s": 0.5})])
        assert [e["action"] for e in third.faults] == ["kill"]
        assert not project_containers()  # a fault touched them: removed after the run
        fourth = run_point(backend, cfg, tmp_path / "point" / "r3", progress=print)
        assert fourth.status == "ok", fourth.error
        assert not backend.last_run_reused
    finally:
        backend.close(print)
    assert not project_containers()
    assert not backend._pool.control_dir.exists()


def test_a_kept_container_is_shaped_again_from_scratch(docker_ready, tmp_path):
    from harness.results.report import load_report_json
    from harness.spec.points import build_spec
    from harness.sweep import run_sweep

    spec = build_spec({
        "name": "reuse-links", "repeats": 2,
        "base": {**FAST, "num_workers": 2,
                 "link": {"all": {"rate": "200mbit"}, "worker-2": {"rate": "50mbit", "qdisc": "tbf", "ingress": True}}},
    }, "reuse-links.yaml")
    point = load_report_json(run_sweep(spec, "docker", tmp_path, progress=print))["points"][0]
    assert point["status"] == "ok", point["error"]
    first, second = point["repeats"]
    assert {c["reused_container"] for c in first["containers"].values()} == {False}
    assert {c["reused_container"] for c in second["containers"].values()} == {True}
    for repeat in (first, second):  # the same tree each time, not added to the last run's (which tc would refuse)
        records = {(r["role"], r["worker_index"]): r for r in repeat["links"]["containers"].values()}
        assert records[("worker", 2)]["applied_rate_bps"] == 50_000_000
        assert records[("worker", 2)]["devices"] == ["eth0", "ifb0"]
        assert records[("coordinator", None)]["applied_rate_bps"] == 200_000_000
    assert not project_containers()
