"""Held-out evaluation during training (wiiide.training.evaluation): the ordered curve, the first crossing of
the target, "not reached", and the background thread evaluating copies of the parameters."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

from wiiide.config import RunConfig
from wiiide.errors import ConfigError
from wiiide.training.evaluation import (
    BackgroundEvaluator,
    Evaluation,
    HeldOutCurve,
    first_crossing,
    record_held_out,
    stop_at_target,
    target_of,
)
from wiiide.metrics import NodeMetrics
from wiiide.training.model import FlatParams, build_mlp, held_out_metric


def _curve(values, higher=True, target=0.9):
    curve = HeldOutCurve("accuracy" if higher else "validation_loss", higher, target)
    for i, v in enumerate(values):
        curve.add(Evaluation(t_s=0.5 * i, step=10 * i, samples=320 * i, value=v))
    return curve


def test_first_crossing_is_the_first_evaluation_at_or_past_the_target():
    curve = _curve([0.1, 0.6, 0.91, 0.85, 0.95])
    assert curve.crossing.step == 20 and curve.time_to_target_s == 1.0
    assert _curve([0.1, 0.9]).time_to_target_s == 0.5  # reaching it exactly counts
    lm = _curve([5.0, 3.2, 2.9, 3.1], higher=False, target=3.0)  # a loss falls to its target
    assert lm.time_to_target_s == 1.0 and lm.crossing.value == 2.9


def test_target_not_reached_gives_none_and_says_so():
    record = _curve([0.1, 0.5, 0.89]).to_dict()
    assert record["time_to_target_s"] is None and record["target_reached"] is False
    assert record["step_at_target"] is None and record["evaluations"] == 3
    assert [p["value"] for p in record["curve"]] == [0.1, 0.5, 0.89]
    no_target = _curve([0.1, 0.99], target=None).to_dict()
    assert no_target["target_reached"] is None and no_target["time_to_target_s"] is None
    assert first_crossing([Evaluation(0.0, 0, 0, float("nan"))], 0.5, False) is None  # NaN reaches nothing


def test_curve_refuses_an_evaluation_out_of_order():
    curve = _curve([0.1, 0.2])
    with pytest.raises(ValueError, match="comes before"):
        curve.add(Evaluation(t_s=0.1, step=30, samples=0, value=0.3))


def test_target_of_picks_the_target_that_fits_the_metric():
    assert target_of(True, 0.95, 0.0) == 0.95
    assert target_of(False, 0.95, 2.5) == 2.5
    assert target_of(False, 0.95, 0.0) is None


def test_config_needs_eval_every_s_for_a_target():
    with pytest.raises(ConfigError, match="target_accuracy.*eval_every_s"):
        RunConfig(target_accuracy=0.9)
    with pytest.raises(ConfigError, match="target_accuracy"):
        RunConfig(eval_every_s=1, target_accuracy=1.5)
    cfg = RunConfig.from_env({"WIIIIIDE_EVAL_EVERY_S": "0.5", "WIIIIIDE_TARGET_LOSS": "2.5"})
    assert (cfg.eval_every_s, cfg.target_loss) == (0.5, 2.5)
    assert RunConfig.from_env(cfg.to_env()) == cfg


class _Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


class _Data:
    """A held-out split where a 1-feature linear model predicts class 1 iff w * x > 0: accuracy 1 for
    w > 0, 0 for w < 0."""

    def __init__(self):
        self.x_test = torch.tensor([[1.0], [2.0], [3.0], [-1.0]]).numpy()
        self.y_test = torch.tensor([1, 1, 1, 0]).numpy()


def _model():
    torch.manual_seed(0)
    return torch.nn.Linear(1, 1, bias=False)


def _metric(model, data):
    x = torch.from_numpy(data.x_test)
    pred = (model(x)[:, 0] > 0).long()
    return "accuracy", (pred == torch.from_numpy(data.y_test)).float().mean().item(), True


def test_background_evaluator_records_snapshots_in_order_and_finds_the_crossing():
    clock = _Clock()
    ev = BackgroundEvaluator(_model(), _Data(), every_s=1.0, target_accuracy=0.9, metric_fn=_metric, clock=clock)
    ev.start()
    weights = [-1.0, -1.0, 1.0, 1.0]  # accuracy 0, 0, 1, 1
    taken = []
    for step in range(8):
        clock.now += 0.5  # two steps per second: a snapshot every other step
        w = torch.tensor([weights[min(step // 2, 3)]])
        taken.append(ev.offer(step, 32 * step, w))
        while ev._busy:  # let the thread finish (a test of order, not of timing)
            threading.Event().wait(0.001)
    ev.finish(8, 256, torch.tensor([1.0]))
    record = ev.to_dict()
    assert taken == [True, False, True, False, True, False, True, False]
    steps = [p["step"] for p in record["curve"]]
    assert steps == [0, 2, 4, 6, 8] and record["curve"][-1]["final"] is True
    assert [p["value"] for p in record["curve"]] == [0.0, 0.0, 1.0, 1.0, 1.0]
    assert [p["t_s"] for p in record["curve"]][:4] == [0.5, 1.5, 2.5, 3.5]
    assert record["time_to_target_s"] == 2.5 and record["step_at_target"] == 4 and record["samples_at_target"] == 128
    assert record["metric"] == "accuracy" and record["target_reached"] is True and record["error"] is None


def test_a_busy_evaluator_skips_the_snapshot_instead_of_waiting():
    clock = _Clock()
    release = threading.Event()
    entered = threading.Event()

    def slow_metric(model, data):
        entered.set()
        release.wait(10)
        return "accuracy", 0.5, True

    ev = BackgroundEvaluator(_model(), _Data(), every_s=1.0, target_accuracy=0.9, metric_fn=slow_metric, clock=clock)
    ev.start()
    assert ev.offer(0, 0, torch.tensor([1.0]))
    entered.wait(10)
    clock.now += 5
    assert not ev.offer(1, 32, torch.tensor([1.0]))  # returns at once: the thread is still evaluating
    assert ev.skipped_busy == 1
    release.set()
    ev.finish(1, 32)
    record = ev.to_dict()
    assert record["evaluations"] == 1 and record["target_reached"] is False and record["time_to_target_s"] is None


def test_snapshot_is_a_copy_and_a_failing_metric_is_recorded_not_raised():
    model = build_mlp(4, [3], 2, seed=0)
    flat = FlatParams(model)
    seen = []

    def metric(m, data):
        seen.append(torch.cat([p.reshape(-1) for p in m.parameters()]))
        raise RuntimeError("shapes do not fit")

    ev = BackgroundEvaluator(build_mlp(4, [3], 2, seed=1), None, every_s=1.0, metric_fn=metric)
    ev.start()
    ev.offer(0, 0, model.parameters)  # the parameters in order, as DDP's rank 0 offers them
    ev.finish(0, 0)
    assert torch.equal(seen[0], flat.params) and seen[0].data_ptr() != flat.params.data_ptr()
    assert ev.to_dict()["error"] == "RuntimeError: shapes do not fit" and ev.to_dict()["evaluations"] == 0
    assert not ev.due()  # evaluation stops after an error; training goes on
    with pytest.raises(ValueError, match="values"):
        BackgroundEvaluator(build_mlp(4, [3], 2, seed=1), None, every_s=1.0)._copy([torch.zeros(5)])


def test_held_out_metric_of_the_mlp_and_the_node_record():
    class Data:
        x_test = torch.zeros(6, 4).numpy()
        y_test = torch.tensor([0, 1, 0, 1, 0, 1]).numpy()

    name, value, higher = held_out_metric(build_mlp(4, [3], 2, seed=0), Data())
    assert (name, higher) == ("accuracy", True) and value == 0.5  # one prediction for identical rows
    ev = BackgroundEvaluator(build_mlp(4, [3], 2, seed=0), Data(), every_s=2.0, target_accuracy=0.4,
                             target_loss=3.0)
    ev.start()
    ev.finish(0, 0, build_mlp(4, [3], 2, seed=0).parameters())
    metrics = NodeMetrics("coordinator", "c")
    record_held_out(metrics, ev)
    held = metrics.to_dict("ok")["held_out"]
    assert metrics.extra["time_to_target_s"] == held["time_to_target_s"] == held["curve"][0]["t_s"]
    assert "target_loss does not apply" in held["target_note"]


def test_stop_at_target_answers_only_once_the_target_is_reached_and_only_when_asked():
    clock = _Clock()
    ev = BackgroundEvaluator(_model(), _Data(), every_s=1.0, target_accuracy=0.9, metric_fn=_metric, clock=clock)
    ev.start()
    on, off = SimpleNamespace(stop_at_target=True), SimpleNamespace(stop_at_target=False)
    answers = []
    for step, weight in enumerate([-1.0, -1.0, 1.0]):  # accuracy 0, 0, 1
        clock.now += 1.0
        ev.offer(step, 32 * step, torch.tensor([weight]))
        while ev._busy:  # let the thread finish (a test of order, not of timing)
            threading.Event().wait(0.001)
        answers.append((stop_at_target(off, ev), stop_at_target(on, ev)))
    ev.finish(3, 96)
    assert answers == [(False, False), (False, False), (False, True)]
    assert ev.target_reached and ev.to_dict()["stopped_at_target"] is True
    assert stop_at_target(on, None) is False  # no evaluator: nothing to stop at


def test_stop_at_target_needs_a_target():
    with pytest.raises(ConfigError, match="stop_at_target"):
        RunConfig(eval_every_s=1.0, stop_at_target=True)
    assert RunConfig(eval_every_s=1.0, target_loss=2.0, stop_at_target=True).stop_at_target is True
