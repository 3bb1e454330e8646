"""The one run loop (harness.run.loop.run_point) over a scripted backend: the order of the backend's
calls, judging from node metrics and exit codes, the timeout, failures while starting, phase timings;
and `up`'s point from --set / --spec, validated as a sweep point."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from harness.cli import up_point
from harness.errors import ClusterError, SpecError
from harness.run.backend import Backend, Collected, PhaseClock
from harness.run.local import LocalBackend
from harness.run.loop import run_point
from wiiide.config import RunConfig


class ScriptedBackend:
    """A backend whose nodes 'run' for `polls_running` polls, then exit with `exit_codes`; it writes the
    node metrics files a real cluster would and records every call in `calls`."""

    name = "scripted"
    poll_interval_s = 0.01

    def __init__(self, polls_running: int = 2, exit_codes: dict[str, int] | None = None,
                 start_error: Exception | None = None, worker_status: str = "ok") -> None:
        self.calls: list[str] = []
        self.polls_running = polls_running
        self.exit_codes = exit_codes or {"coordinator": 0, "worker-1": 0, "worker-2": 0}
        self.start_error = start_error
        self.worker_status = worker_status
        self.out_dir: Path | None = None

    def describe(self):
        return {"name": self.name}

    def check_cluster(self, cluster):
        self.calls.append("check_cluster")

    def check_faults(self, faults):
        self.calls.append("check_faults")

    def start(self, cfg, out_dir, cluster, progress, clock):
        self.calls.append("start")
        self.out_dir = out_dir
        with clock.phase("create"):
            pass
        if self.start_error is not None:
            raise self.start_error
        return object()  # a Controller; no faults are injected here

    def poll(self):
        self.calls.append("poll")
        if self.polls_running > 0:
            self.polls_running -= 1
            return {name: "running" for name in self.exit_codes}
        nodes = self.out_dir / "nodes"
        (nodes / "coordinator.json").write_text(json.dumps({"schema_version": _node_schema(), "status": "ok"}))
        for name in self.exit_codes:
            if name.startswith("worker"):
                (nodes / f"{name}.json").write_text(json.dumps(
                    {"schema_version": _node_schema(), "status": self.worker_status, "rank": int(name[-1]),
                     "error": None if self.worker_status == "ok" else "lost the coordinator"}))
        return {name: "exited" for name in self.exit_codes}

    def stop(self):
        self.calls.append("stop")

    def collect(self, logs_dir, progress):
        self.calls.append("collect")
        return Collected(exit_codes=dict(self.exit_codes))

    def teardown(self):
        self.calls.append("teardown")


def _node_schema():
    from wiiide.metrics import SCHEMA_VERSION
    return SCHEMA_VERSION


CFG = RunConfig(num_workers=2, duration_s=1)


def test_both_backends_satisfy_the_protocol():
    assert isinstance(LocalBackend(), Backend)
    assert isinstance(ScriptedBackend(), Backend)


def test_calls_come_in_order_and_an_ok_run_is_judged_ok(tmp_path):
    backend = ScriptedBackend(polls_running=2)
    result = run_point(backend, CFG, tmp_path, timeout_s=60, progress=lambda line: None)
    assert result.status == "ok", result.error
    assert backend.calls == ["check_cluster", "check_faults", "start", "poll", "poll", "poll",
                             "stop", "collect", "teardown"]
    assert list(result.phases_s) == ["create", "run", "stop", "collect", "teardown"]
    assert set(result.nodes) == {"coordinator", "worker-1", "worker-2"}
    assert result.exit_codes == {"coordinator": 0, "worker-1": 0, "worker-2": 0}


def test_a_node_exiting_non_zero_fails_the_run_with_its_name(tmp_path):
    backend = ScriptedBackend(polls_running=0, exit_codes={"coordinator": 0, "worker-1": 4, "worker-2": 0},
                              worker_status="failed")
    result = run_point(backend, CFG, tmp_path, timeout_s=60, progress=lambda line: None)
    assert result.status == "failed"
    assert "worker-1 exited 4" in result.error and "lost the coordinator" in result.error


def test_the_deadline_stops_a_run_that_never_ends_and_still_tears_down(tmp_path):
    backend = ScriptedBackend(polls_running=10**9)
    result = run_point(backend, CFG, tmp_path, timeout_s=0.3, progress=lambda line: None)
    assert result.status == "failed" and result.error.startswith("timed out after 0 s")
    assert backend.calls[-3:] == ["stop", "collect", "teardown"]
    assert "the coordinator wrote no metrics" in result.error


def test_a_failure_while_starting_is_recorded_and_torn_down(tmp_path):
    backend = ScriptedBackend(start_error=ClusterError("compose up failed: no such image"))
    result = run_point(backend, CFG, tmp_path, timeout_s=60, progress=lambda line: None)
    assert result.status == "failed" and result.error.startswith("compose up failed: no such image")
    assert "poll" not in backend.calls
    assert backend.calls[-3:] == ["stop", "collect", "teardown"]


def test_an_interrupted_attempts_files_are_set_aside_not_mixed_into_the_new_run(tmp_path):
    # A sweep resumed after an interruption runs a repeat again in the same folder: the old attempt's
    # metrics (here a worker-3 that this run does not have) and progress files must not count.
    out = tmp_path / "point-000" / "repeat-2"
    (out / "nodes" / "progress").mkdir(parents=True)
    (out / "nodes" / "worker-3.json").write_text(json.dumps({"schema_version": _node_schema(), "status": "failed"}))
    (out / "nodes" / "progress" / "old-node.json").write_text('{"rank": 1, "phase": "train", "step": 201}')
    lines: list[str] = []
    result = run_point(ScriptedBackend(polls_running=1), CFG, out, timeout_s=60, progress=lines.append)
    assert result.status == "ok", result.error
    assert set(result.nodes) == {"coordinator", "worker-1", "worker-2"}
    assert not (out / "nodes" / "progress" / "old-node.json").exists()
    kept = tmp_path / "point-000" / "repeat-2.interrupted-1"
    assert (kept / "nodes" / "worker-3.json").exists() and (kept / "nodes" / "progress" / "old-node.json").exists()
    assert any("repeat-2.interrupted-1" in line for line in lines)
    # a second resume keeps both earlier attempts
    result = run_point(ScriptedBackend(polls_running=1), CFG, out, timeout_s=60, progress=lambda line: None)
    assert (tmp_path / "point-000" / "repeat-2.interrupted-2" / "nodes" / "coordinator.json").exists()


def test_phase_clock_adds_up_a_phase_timed_twice_and_times_a_raising_body():
    ticks = iter([0.0, 1.0, 3.0, 10.0, 10.5, 20.0, 29.5])  # the first: the clock's start
    clock = PhaseClock(clock=lambda: next(ticks))
    with clock.phase("shape"):
        pass
    with pytest.raises(ValueError):
        with clock.phase("gate"):
            raise ValueError("boom")
    with clock.phase("shape"):
        pass
    assert clock.phases_s == {"shape": 2.0 + 9.5, "gate": 0.5}


def _up_args(**kw) -> argparse.Namespace:
    defaults = {"workers": None, "duration_s": None, "set": None, "spec": None, "point": None}
    return argparse.Namespace(**{**defaults, **kw})


def test_up_set_takes_config_fields_and_cluster_keys():
    point = up_point(_up_args(set=["link=rate-100m", "cpus=0.5", "compression=zlib-1"], workers=3))
    assert point.config.num_workers == 3 and point.config.compression == "zlib-1"
    assert point.config.duration_s == 300.0  # a long-running cluster by default
    assert point.cluster.link is not None and point.cluster.link.label == "rate-100m"
    assert point.cluster.cpus.for_container("worker", 1) == 0.5


def test_up_set_values_are_validated_as_in_a_sweep():
    with pytest.raises(SpecError, match="unknown config field"):
        up_point(_up_args(set=["sndbuf=8MiB"]))
    with pytest.raises(SpecError, match="unknown link preset"):
        up_point(_up_args(set=["link=no-such-preset"]))
    with pytest.raises(SpecError, match="expected key=value"):
        up_point(_up_args(set=["link"]))
    with pytest.raises(SpecError, match="disagree"):
        up_point(_up_args(set=["num_workers=3"], workers=4))


def test_up_spec_point_takes_that_points_values_and_set_overrides_the_base(tmp_path):
    spec = tmp_path / "s.yaml"
    spec.write_text("name: s\nbase: {num_workers: 2, duration_s: 20}\n"
                    "axes: {link: [rate-100m, none], compression: [none, zlib-1]}\n")
    point = up_point(_up_args(spec=str(spec), point=1, set=["batch_size=16"]))
    assert point.params == {"link": "rate-100m", "compression": "zlib-1"}
    assert point.config.batch_size == 16 and point.config.duration_s == 20
    with pytest.raises(SpecError, match="is an axis"):
        up_point(_up_args(spec=str(spec), point=0, set=["compression=zlib-1"]))
    with pytest.raises(SpecError, match="has points 0..3"):
        up_point(_up_args(spec=str(spec), point=4))
