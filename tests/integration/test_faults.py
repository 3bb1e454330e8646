"""Faults on the local backend: a worker killed and restarted rejoins, a paused worker is dropped and
comes back, a killed coordinator fails the point with its cause within the bound, and the sweep's
report keeps every finished point when the harness is interrupted (resume skips them)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.results.report import (
    load_report_json as load_report,  # the report as its JSON object
)
from harness.spec.points import build_spec
from harness.sweep import run_sweep

REPO_ROOT = Path(__file__).resolve().parents[2]
FAST = {"dataset": "digits", "num_workers": 2, "log_tier": "normal", "log_every_steps": 100000,
        "io_timeout_s": 2.0, "heartbeat_interval_s": 0.5, "connect_timeout_s": 30,
        "ps_shards": "1"}  # the central server's faults (the sharded ones: test_worker_loss_sharded.py)


def _events(rep, kind):
    return [e for e in rep["nodes"]["coordinator"]["events"] if e["event"] == kind]


def test_worker_killed_then_restarted_rejoins_with_its_rank(tmp_path):
    spec = build_spec({"name": "kill-restart", "base": {**FAST, "duration_s": 8},
                       "faults": [{"action": "kill", "target": "worker-1", "at_s": 2},
                                  {"action": "restart", "target": "worker-1", "at_s": 3}]}, "kill.yaml")
    report = load_report(run_sweep(spec, "local", tmp_path, progress=lambda line: None))
    rep = report["points"][0]["repeats"][0]
    assert rep["status"] == "ok", rep["error"]
    assert [(f["action"], f["ok"]) for f in rep["faults"]] == [("kill", True), ("restart", True)]
    lost, rejoined = _events(rep, "worker_lost"), _events(rep, "worker_rejoined")
    assert len(lost) == 1 and len(rejoined) == 1
    assert lost[0]["rank"] == rejoined[0]["rank"] and lost[0]["node_id"] == rejoined[0]["node_id"]
    assert rejoined[0]["step"] > 0  # came back mid-run, at a later step, with the current parameters
    coord = rep["nodes"]["coordinator"]
    # the killed rank trained before and after, but missed the steps in between
    counts = coord["batches_per_worker"]
    assert 0 < counts[str(lost[0]["rank"])] < coord["steps"]
    assert rep["totals"]["test_accuracy"] > 0.5


def test_paused_worker_is_dropped_within_io_timeout_and_rejoins(tmp_path):
    spec = build_spec({"name": "pause", "base": {**FAST, "duration_s": 9},
                       "faults": [{"action": "pause", "target": "worker-2", "at_s": 2, "duration_s": 4}]}, "pause.yaml")
    report = load_report(run_sweep(spec, "local", tmp_path, progress=lambda line: None))
    rep = report["points"][0]["repeats"][0]
    assert rep["status"] == "ok", rep["error"]
    lost, rejoined = _events(rep, "worker_lost"), _events(rep, "worker_rejoined")
    assert len(lost) == 1 and "timeout" in lost[0]["cause"].lower()
    pause_t = next(f["t_s"] for f in rep["faults"] if f["action"] == "pause")
    train_start = next(e["t_s"] for e in rep["nodes"]["coordinator"]["events"] if e["event"] == "worker_joined")
    # detected no sooner than the timeout after the pause (loose upper bound: the machine is shared)
    assert lost[0]["t_s"] - train_start >= pause_t + 2.0 - 0.5
    assert len(rejoined) == 1 and rejoined[0]["rank"] == lost[0]["rank"]
    worker = next(n for name, n in rep["nodes"].items() if name.startswith("worker") and n["rank"] == lost[0]["rank"])
    assert any(e["event"] == "coordinator_lost" for e in worker["events"])


def test_killed_coordinator_fails_the_point_and_workers_exit_within_bound(tmp_path):
    spec = build_spec({"name": "coord-kill", "base": {**FAST, "duration_s": 30},
                       "faults": [{"action": "kill", "target": "coordinator", "at_s": 2}],
                       "axes": {"compression": ["none"]}}, "ck.yaml")
    report = load_report(run_sweep(spec, "local", tmp_path, progress=lambda line: None))
    point = report["points"][0]
    assert point["status"] == "failed"
    assert "coordinator exited -9" in point["error"] and "coordinator wrote no metrics" in point["error"]
    rep = point["repeats"][0]
    assert rep["exit_codes"]["worker-1"] == 4 and rep["exit_codes"]["worker-2"] == 4
    assert [(f["action"], f["target"], f["ok"]) for f in rep["faults"]] == [("kill", "coordinator", True)]
    for name in ("worker-1", "worker-2"):
        node = rep["nodes"][name]
        assert node["status"] == "failed" and "lost the coordinator" in node["error"]
        _assert_gave_up_in_time(node, FAST["io_timeout_s"], planned_s=30)
    assert report["complete"] is True


def _assert_gave_up_in_time(worker: dict, io_timeout_s: float, planned_s: float) -> None:
    """In the worker's own clock (its metrics), so a loaded machine cannot fail it: it noticed the
    coordinator was gone, then gave up within 2 x io_timeout_s (plus a generous 10 s), and ended long
    before the `planned_s` seconds of training would have."""
    lost = [e for e in worker["events"] if e["event"] == "coordinator_lost"]
    assert lost, worker["events"]
    assert lost[0]["t_s"] <= worker["wall_time_s"] <= lost[0]["t_s"] + 2 * io_timeout_s + 10
    assert worker["wall_time_s"] < planned_s


def test_interrupted_sweep_keeps_finished_points_and_resume_skips_them(tmp_path):
    spec_path = tmp_path / "two.yaml"
    spec_path.write_text(json.dumps({"name": "two", "base": {**FAST, "max_steps": 40, "duration_s": 60},
                                     "axes": {"batch_size": [16, 17, 18]}}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("WIIIIIDE_")}
    proc = subprocess.Popen([sys.executable, "-m", "harness", "sweep", str(spec_path), "--backend", "local",
                             "--results-dir", str(tmp_path / "results")], cwd=REPO_ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    report_path = None
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:  # interrupt once the first point is in the report
        found = list((tmp_path / "results").glob("two-*/report.json"))
        if found:
            report_path = found[0]
            try:
                data = json.loads(report_path.read_text())
            except ValueError:  # never half-written: the writer renames a complete file into place
                pytest.fail("report.json was read half-written")
            if data["points"] and data["points"][0]["status"] == "ok":
                break
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    data = json.loads(report_path.read_text())
    assert data["complete"] is False and "interrupted" in data["note"]
    assert data["points"][0]["status"] == "ok"
    done_before = [p["index"] for p in data["points"] if p["status"] == "ok"]
    assert _our_nodes(report_path.parent) == []  # every node was stopped

    out = subprocess.run([sys.executable, "-m", "harness", "sweep", str(spec_path), "--backend", "local",
                          "--resume", str(report_path.parent)], cwd=REPO_ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    resumed = json.loads(report_path.read_text())
    assert resumed["complete"] is True
    assert [p["status"] for p in resumed["points"]] == ["ok", "ok", "ok"]
    for index in done_before:  # finished points were kept as they were, not run again
        assert resumed["points"][index]["repeats"] == data["points"][index]["repeats"]
    assert "skipping" in out.stderr


def _our_nodes(run_dir: Path) -> list[int]:
    """PIDs of wiiide nodes whose metrics dir is under `run_dir`."""
    import psutil

    pids = []
    for proc in psutil.process_iter(["pid", "cmdline", "environ"]):
        try:
            env = proc.info["environ"] or {}
        except psutil.Error:
            continue
        if str(run_dir) in env.get("WIIIIIDE_METRICS_DIR", ""):
            pids.append(proc.info["pid"])
    return pids
