"""``sweep --sched-trace`` on the local backend: each repeat records what the machine's scheduler did
over the coordinator's timed steps (`harness.analysis.sched_trace`), and the trace leaves nothing behind."""

from __future__ import annotations

import os

import pytest

from harness.errors import HarnessError
from harness.results.report import load_report_json
from harness.analysis.sched_trace import TRACEFS
from harness.spec.points import build_spec
from harness.sweep import run_sweep

needs_tracefs = pytest.mark.skipif(os.geteuid() != 0 or not TRACEFS.exists(), reason="needs root and tracefs")


def _spec():
    return build_spec({
        "name": "sched-trace", "repeats": 1,
        "base": {"dataset": "digits", "num_workers": 2, "max_steps": 60, "warmup_steps": 10, "duration_s": 60,
                 "log_tier": "silent", "connect_timeout_s": 30, "ps_shards": "all", "torch_threads": 1},
        "axes": {"compression": ["none"]},
    }, "sched-trace.yaml")


@needs_tracefs
def test_a_traced_sharded_run_records_the_cores_idle_and_lost_over_its_timed_steps(tmp_path):
    instances_before = sorted(p.name for p in (TRACEFS / "instances").iterdir()) \
        if (TRACEFS / "instances").is_dir() else None
    path = run_sweep(_spec(), "local", tmp_path, progress=lambda line: None, sched_trace=True)
    rep = load_report_json(path)["points"][0]["repeats"][0]
    assert rep["status"] == "ok", rep["error"]
    sched, window = rep["sched"], rep["nodes"]["coordinator"]["host_cpu_s"]
    assert "error" not in sched, sched
    assert sched["window_s"] == pytest.approx(window["end_monotonic_s"] - window["start_monotonic_s"])
    assert sched["cpus"] == os.cpu_count()
    assert sched["switches"] > 50 * 2  # 50 timed steps, each with pushes and pulls between 3 processes
    assert 0.0 <= sched["idle_while_waiting_s"] <= sched["idle_s"] <= sched["window_s"] * sched["cpus"]
    assert sched["lost_cores"] == pytest.approx(sched["idle_while_waiting_s"] / sched["window_s"])
    # the idle time rebuilt from the events is the kernel's own count of it (ticks of 10 ms per CPU)
    assert sched["idle_s"] == pytest.approx(window["idle"] + window["iowait"], rel=0.15, abs=0.05)
    assert rep["phases_s"]["sched"] >= 0.0
    after = sorted(p.name for p in (TRACEFS / "instances").iterdir()) if (TRACEFS / "instances").is_dir() else None
    assert after == instances_before  # the run's instance is gone (and a mount it made, with it)


def test_the_trace_is_refused_where_the_nodes_are_not_on_this_kernel(tmp_path):
    class Swarm:
        name = "swarm"

        def check_cluster(self, cluster):
            pass

        def check_faults(self, faults):
            pass

    with pytest.raises(HarnessError, match="docker and local backends only"):
        run_sweep(_spec(), "swarm", tmp_path, progress=lambda line: None, backend=Swarm(), sched_trace=True)
    assert not list(tmp_path.iterdir())  # refused before a report was begun
