"""Time to target on the local backend: the parameter server, DDP and FSDP evaluate snapshots of the
parameters during training (eval_every_s) and record an ordered held-out curve and the time at which
accuracy first reached target_accuracy; the report carries both."""

from __future__ import annotations

import pytest

from harness.present.table import format_table
from harness.results.report import load_report
from harness.spec.points import build_spec
from harness.sweep import run_sweep

TARGET = 0.9
STEPS = 300  # digits MLP, lr 0.1, global batch 64: above 0.9 held-out accuracy well before this


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    spec = build_spec({
        "name": "ttt-tiny", "repeats": 1,
        "base": {"dataset": "digits", "num_workers": 2, "max_steps": STEPS, "duration_s": 120, "log_tier": "silent",
                 "connect_timeout_s": 60, "eval_every_s": 0.1, "target_accuracy": TARGET},
        # the central server's curve starts at the initial model (step 0); the sharded servers' first
        # evaluation comes after the first pulls from the shards
        "axes": {"engine": [{"label": "wiiide", "engine": "wiiide", "ps_shards": "1"}, "ddp", "fsdp"]},
    }, "ttt-tiny.yaml")
    return load_report(run_sweep(spec, "local", tmp_path_factory.mktemp("results"), progress=lambda line: None))


def test_every_engine_records_an_ordered_curve_and_its_time_to_target(report):
    for point in report.points:
        engine = point.params["engine"]
        assert point.status == "ok", point.error
        rep = point.repeats[0]
        held = rep.held_out
        assert held is not None and held.metric == "accuracy" and held.target == TARGET, engine
        assert held.error is None and held.evaluations == len(held.curve) >= 2, engine
        times, steps = [p.t_s for p in held.curve], [p.step for p in held.curve]
        assert times == sorted(times) and steps == sorted(steps), engine
        assert steps[0] == 0 and held.curve[0].value < 0.5, engine  # the initial model, before any step
        assert held.curve[-1].final and steps[-1] == STEPS, engine
        assert held.curve[-1].value == pytest.approx(rep.totals.test_accuracy), engine  # the final evaluation
        first = next(p for p in held.curve if p.value >= TARGET)
        assert held.time_to_target_s == first.t_s == rep.totals.time_to_target_s, engine
        assert held.step_at_target == first.step and rep.totals.target_reached is True, engine
        assert point.summary["time_to_target_s"].median == first.t_s, engine
        assert rep.nodes["coordinator"]["time_to_target_s"] == first.t_s, engine
        for name, node in rep.nodes.items():  # only the coordinator / rank 0 evaluates
            assert ("held_out" in node) == (name == "coordinator"), (engine, name)


def test_the_table_shows_time_to_target(report):
    table = format_table(report)
    assert "to target s" in table and "not reached" not in table


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    spec = build_spec({
        "name": "ttt-stop", "repeats": 1,
        "base": {"dataset": "digits", "num_workers": 2, "max_steps": 5000, "duration_s": 120, "log_tier": "silent",
                 "connect_timeout_s": 60, "eval_every_s": 0.1, "target_accuracy": TARGET, "stop_at_target": True},
        "axes": {"engine": ["wiiide", {"label": "wiiide-async", "engine": "wiiide", "staleness_bound": "async"},
                            "ddp", "fsdp"]},
    }, "ttt-stop.yaml")
    return load_report(run_sweep(spec, "local", tmp_path_factory.mktemp("results"), progress=lambda line: None))


def test_stop_at_target_ends_every_engine_soon_after_the_first_crossing(stopped):
    for point in stopped.points:
        label = point.index
        assert point.status == "ok", point.error
        rep = point.repeats[0]
        held = rep.held_out
        assert held.stopped_at_target is True and rep.totals.target_reached is True, label
        final = held.curve[-1]  # evaluated after the stop: it may sit a little either side of the target
        assert final.final and any(p.value >= TARGET for p in held.curve[:-1]), label
        # far fewer than max_steps: training ended at the target, not at a step or time limit
        assert held.step_at_target <= final.step < 5000 and final.t_s < 120, label
