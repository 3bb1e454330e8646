"""Faults in containers: a worker container killed and started again rejoins; a killed coordinator
fails the point with its cause while every worker exits within the bound."""

from __future__ import annotations

import re

import pytest

from harness.results.report import (
    load_report_json as load_report,  # the report as its JSON object
)
from harness.spec.points import build_spec
from harness.sweep import run_sweep

pytestmark = pytest.mark.docker
FAST = {"dataset": "digits", "num_workers": 2, "log_tier": "normal", "log_every_steps": 100000,
        "io_timeout_s": 3.0, "heartbeat_interval_s": 0.5}


def test_worker_container_killed_and_restarted_rejoins(docker_ready, tmp_path):
    spec = build_spec({"name": "docker-kill", "base": {**FAST, "duration_s": 10},
                       "faults": [{"action": "kill", "target": "worker-1", "at_s": 2},
                                  {"action": "restart", "target": "worker-1", "at_s": 3}]}, "docker-kill.yaml")
    rep = load_report(run_sweep(spec, "docker", tmp_path, progress=print))["points"][0]["repeats"][0]
    assert rep["status"] == "ok", rep["error"]
    assert [(f["action"], f["ok"]) for f in rep["faults"]] == [("kill", True), ("restart", True)]
    events = rep["nodes"]["coordinator"]["events"]
    lost = [e for e in events if e["event"] == "worker_lost"]
    rejoined = [e for e in events if e["event"] == "worker_rejoined"]
    assert len(lost) == 1 and len(rejoined) == 1 and lost[0]["node_id"] == rejoined[0]["node_id"]
    assert rep["totals"]["test_accuracy"] > 0.5


def test_coordinator_container_killed_fails_point_within_bound(docker_ready, tmp_path):
    spec = build_spec({"name": "docker-coord-kill", "base": {**FAST, "duration_s": 40},
                       "faults": [{"action": "kill", "target": "coordinator", "at_s": 2}]}, "docker-ck.yaml")
    point = load_report(run_sweep(spec, "docker", tmp_path, progress=print))["points"][0]
    assert point["status"] == "failed" and re.search(r"coordinator\S* exited 137", point["error"])
    rep = point["repeats"][0]
    assert [(f["action"], f["target"], f["ok"]) for f in rep["faults"]] == [("kill", "coordinator", True)]
    workers = [n for name, n in rep["nodes"].items() if name.startswith("worker")]
    assert len(workers) == 2
    for worker in workers:  # in the worker's own clock: noticed the loss, gave up in time, long before 40 s
        assert worker["status"] == "failed" and "lost the coordinator" in worker["error"]
        lost = [e for e in worker["events"] if e["event"] == "coordinator_lost"]
        assert lost and lost[0]["t_s"] <= worker["wall_time_s"] <= lost[0]["t_s"] + 2 * FAST["io_timeout_s"] + 10
        assert worker["wall_time_s"] < 40
    assert sorted(code for name, code in rep["exit_codes"].items() if "worker" in name) == [4, 4]
