"""Held-out evaluation during training, and time to target, for every engine.

A `BackgroundEvaluator` evaluates a *copy* of the parameters on a thread of its own, so that training
never waits for it: every ``eval_every_s`` seconds the training loop, between two steps, offers the
current parameters (`offer`); when an evaluation is due and the thread is idle, the parameters are
copied into the evaluator's own model (one memcpy of the flat float32 vector, about 20 KB for the
digits MLP) and the thread evaluates that copy with `wiiide.training.model.held_out_metric` while training
goes on. A snapshot due while the previous one is still being evaluated is skipped (counted as
``skipped_busy``), never waited for. The coordinator of the parameter server and rank 0 of the
ddp/fsdp engines run one.

Every evaluation is one `Evaluation`: the wall time since training started *at which the parameters
were copied* (the model had that quality then; how long the evaluation itself took is ``eval_s``),
the step, the samples trained on, and the metric's value. `HeldOutCurve` keeps them in order and
finds the first that reaches the target (`first_crossing`): ``time_to_target_s`` is its ``t_s``, or
None when no evaluation reached it ("not reached"). Targets: ``target_accuracy`` for a metric where
higher is better (classification accuracy), ``target_loss`` for one where lower is better (a
language model's validation loss); see `target_of`.

Threads: the evaluation runs torch ops on the evaluator's thread; the node's intra-op thread count
(``torch_threads``, 1 by default) is process-wide in torch and is left as the node set it, so the
evaluation takes at most that many cores' worth of time from training while it runs.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import nn

from wiiide.metrics import summarize
from wiiide.training.model import FlatParams, held_out_metric

MetricFn = Callable[[nn.Module, Any], "tuple[str, float, bool]"]


@dataclass(frozen=True)
class Evaluation:
    """One held-out evaluation.

    t_s: seconds since training started when the parameters were copied; step: optimizer steps done
    then; samples: training samples seen then; value: the metric (units: the metric's, e.g. accuracy
    in 0..1 or nats); eval_s: seconds the evaluation took; final: the evaluation of the final
    parameters, made after the last step.
    """

    t_s: float
    step: int
    samples: int
    value: float
    eval_s: float = 0.0
    final: bool = False

    def to_dict(self) -> dict[str, Any]:
        """The JSON-ready record of the node's metrics (``held_out.curve`` items)."""
        return asdict(self)


def reaches(value: float, target: float, higher_is_better: bool) -> bool:
    """Whether `value` meets `target`: ``value >= target`` when higher is better, else ``value <= target``;
    a NaN value never does."""
    if math.isnan(value):
        return False
    return value >= target if higher_is_better else value <= target


def first_crossing(curve: Sequence[Evaluation], target: float | None, higher_is_better: bool) -> Evaluation | None:
    """The first evaluation of `curve` (in its order: by time) that reaches `target` (`reaches`);
    None when there is no target or none reaches it."""
    if target is None:
        return None
    return next((e for e in curve if reaches(e.value, target, higher_is_better)), None)


def target_of(metric_higher_is_better: bool, target_accuracy: float, target_loss: float) -> float | None:
    """The configured target for a metric: `target_accuracy` when higher is better, `target_loss` when
    lower is; None when that one is 0 (no target)."""
    target = target_accuracy if metric_higher_is_better else target_loss
    return float(target) if target > 0 else None


class HeldOutCurve:
    """The evaluations of one run, in time order, and the first that reaches the target.

    Args:
        metric: the metric's name (`held_out_metric`'s), e.g. ``accuracy``.
        higher_is_better: True for accuracy, False for a loss.
        target: the value to reach (same unit as the metric), None for no target.
    """

    def __init__(self, metric: str, higher_is_better: bool, target: float | None) -> None:
        self.metric = metric
        self.higher_is_better = higher_is_better
        self.target = target
        self.points: list[Evaluation] = []
        self._lock = threading.Lock()

    def add(self, evaluation: Evaluation) -> None:
        """Append an evaluation. Thread-safe.

        Raises:
            ValueError: its time or step is before the last one's (the curve must stay ordered).
        """
        with self._lock:
            if self.points and (evaluation.t_s < self.points[-1].t_s or evaluation.step < self.points[-1].step):
                last = self.points[-1]
                raise ValueError(f"evaluation at t={evaluation.t_s:.3f} s, step {evaluation.step} comes before the "
                                 f"last one (t={last.t_s:.3f} s, step {last.step})")
            self.points.append(evaluation)

    @property
    def crossing(self) -> Evaluation | None:
        """The first evaluation that reached the target (`first_crossing`), None if none did."""
        with self._lock:
            return first_crossing(self.points, self.target, self.higher_is_better)

    @property
    def time_to_target_s(self) -> float | None:
        """Seconds from the start of training to the first evaluation that reached the target; None
        when there is no target or it was not reached."""
        hit = self.crossing
        return hit.t_s if hit is not None else None

    def to_dict(self) -> dict[str, Any]:
        """The JSON-ready record of the node's metrics (``held_out``): metric, higher_is_better, target,
        target_reached (None without a target), time_to_target_s, step_at_target, samples_at_target
        and the curve."""
        hit = self.crossing
        with self._lock:
            points = list(self.points)
        return {"metric": self.metric, "higher_is_better": self.higher_is_better, "target": self.target,
                "target_reached": None if self.target is None else hit is not None,
                "time_to_target_s": hit.t_s if hit else None, "step_at_target": hit.step if hit else None,
                "samples_at_target": hit.samples if hit else None,
                "evaluations": len(points), "curve": [p.to_dict() for p in points]}


class BackgroundEvaluator:
    """Evaluates snapshots of the parameters on its own thread, every `every_s` seconds of training.

    Args:
        eval_model: a model of the training model's architecture that only the evaluator uses; its
            parameters are overwritten by each snapshot.
        data: what `metric_fn` evaluates on (a `wiiide.training.data.Dataset`).
        every_s: seconds between snapshots (> 0).
        target_accuracy, target_loss: the configured targets (0: none; `target_of` picks the one
            that fits the metric).
        metric_fn: (model, data) -> (name, value, higher_is_better); default `held_out_metric`.
        clock: monotonic seconds (default `time.perf_counter`, the clock the training loops use).

    Use: `start` when training starts, `offer` after every step (or `due` + `submit` when taking the
    snapshot needs every rank, as FSDP's all-gather does), `finish` after the last step, then
    `to_dict` into the node's metrics.

    Raises:
        ValueError: `every_s` is not positive.
    """

    def __init__(self, eval_model: nn.Module, data: Any, every_s: float, target_accuracy: float = 0.0,
                 target_loss: float = 0.0, metric_fn: MetricFn = held_out_metric,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        if not every_s > 0:
            raise ValueError(f"every_s must be > 0 seconds, got {every_s!r}")
        self.model = eval_model
        self.flat = FlatParams(eval_model)
        self.data = data
        self.every_s = float(every_s)
        self.target_accuracy, self.target_loss = float(target_accuracy), float(target_loss)
        self.metric_fn = metric_fn
        self.clock = clock
        self.curve: HeldOutCurve | None = None  # made at the first evaluation, when the metric is known
        self.skipped_busy = 0
        self.error: str | None = None
        self._t0: float | None = None
        self._last_snapshot_t: float | None = None
        self._pending: tuple[float, int, int] | None = None  # (t_s, step, samples) of the copy to evaluate
        self._busy = False
        self._stopping = False
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None
        self.eval_times_s: list[float] = []
        self._reached = False  # set by the thread at the first evaluation that reaches the target
        self.stopped_at_target = False  # training ended because the target was reached (`stop_at_target`)

    # ------------------------------------------------------------------------------------------
    def start(self, t0: float | None = None) -> "BackgroundEvaluator":
        """Start the thread; `t0` is the training start on `clock` (default: now). Returns self."""
        self._t0 = self.clock() if t0 is None else t0
        self._thread = threading.Thread(target=self._loop, name="held-out evaluator", daemon=True)
        self._thread.start()
        return self

    def elapsed_s(self) -> float:
        """Seconds since training started (`start`)."""
        if self._t0 is None:
            raise RuntimeError("the evaluator was not started")
        return self.clock() - self._t0

    def due(self) -> bool:
        """Whether a snapshot is due now: none taken yet, or `every_s` since the last, and the thread
        idle and healthy. Counts a due snapshot skipped because the thread is busy."""
        if self.error is not None or self._stopping:
            return False
        now = self.elapsed_s()
        if self._last_snapshot_t is not None and now - self._last_snapshot_t < self.every_s:
            return False
        if self._busy:
            self.skipped_busy += 1
            self._last_snapshot_t = now  # the next attempt comes every_s later, not at every step
            return False
        return True

    def submit(self, step: int, samples: int, source: torch.Tensor | Iterable[torch.Tensor]) -> None:
        """Copy the parameters now (in the caller's thread, between steps) and have the thread evaluate
        the copy. `source`: the flat float32 vector (numel values) or the parameters in
        ``model.parameters()`` order. Call only when `due` said so.

        Raises:
            ValueError: `source` does not hold the eval model's number of parameters.
        """
        t_s = self.elapsed_s()
        self._copy(source)
        with self._wake:
            self._busy = True
            self._pending = (t_s, step, samples)
            self._last_snapshot_t = t_s
            self._wake.notify()

    def offer(self, step: int, samples: int, source: torch.Tensor | Iterable[torch.Tensor]
              | Callable[[], torch.Tensor | Iterable[torch.Tensor]]) -> bool:
        """`submit` if a snapshot is `due`; `source` may be a callable returning it (called only then).
        Returns whether a snapshot was taken. Cheap when none is due (a clock read)."""
        if not self.due():
            return False
        self.submit(step, samples, source() if callable(source) else source)
        return True

    def finish(self, step: int, samples: int, source: torch.Tensor | Iterable[torch.Tensor] | None = None) -> None:
        """Stop the thread (after the evaluation in flight, if any) and, when `source` is given,
        evaluate the final parameters here, recorded as the final point (its ``t_s``: now)."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join()
        if source is not None and self.error is None:
            t_s = self.elapsed_s()
            self._copy(source)
            self._evaluate(t_s, step, samples, final=True)

    # ------------------------------------------------------------------------------------------
    def _copy(self, source: torch.Tensor | Iterable[torch.Tensor]) -> None:
        with torch.no_grad():
            if isinstance(source, torch.Tensor):
                self.flat.load(source.detach())
                return
            offset = 0
            for p in source:
                n = p.numel()
                if offset + n > self.flat.numel:
                    raise ValueError(f"the parameters hold more than the eval model's {self.flat.numel} values")
                self.flat.params[offset:offset + n].copy_(p.detach().reshape(-1))
                offset += n
            if offset != self.flat.numel:
                raise ValueError(f"the parameters hold {offset} values, the eval model {self.flat.numel}")

    def _loop(self) -> None:
        while True:
            with self._wake:
                while self._pending is None and not self._stopping:
                    self._wake.wait()
                if self._pending is None:
                    return
                t_s, step, samples = self._pending
                self._pending = None
            try:
                self._evaluate(t_s, step, samples)
            finally:
                with self._wake:
                    self._busy = False

    def _evaluate(self, t_s: float, step: int, samples: int, final: bool = False) -> None:
        t0 = time.perf_counter()
        try:
            name, value, higher = self.metric_fn(self.model, self.data)
        except Exception as exc:  # recorded, and evaluation stops; training goes on
            self.error = f"{type(exc).__name__}: {exc}"[:300]
            return
        eval_s = time.perf_counter() - t0
        self.eval_times_s.append(eval_s)
        if self.curve is None:
            self.curve = HeldOutCurve(name, bool(higher), target_of(bool(higher), self.target_accuracy,
                                                                     self.target_loss))
        self.curve.add(Evaluation(round(t_s, 6), int(step), int(samples), float(value), round(eval_s, 6), final))
        if not self._reached and self.curve.crossing is not None:
            self._reached = True

    @property
    def target_reached(self) -> bool:
        """Whether an evaluation so far reached the target (False without a target). Cheap (a flag the
        evaluator's thread sets), so the training loops may ask after every step."""
        return self._reached

    # ------------------------------------------------------------------------------------------
    @property
    def time_to_target_s(self) -> float | None:
        """`HeldOutCurve.time_to_target_s`, None before any evaluation."""
        return self.curve.time_to_target_s if self.curve is not None else None

    def to_dict(self) -> dict[str, Any]:
        """The node's ``held_out`` record: `HeldOutCurve.to_dict` plus eval_every_s, the configured
        targets, skipped_busy (due snapshots skipped because one was still being evaluated), the
        evaluation times (`wiiide.metrics.summarize`, s) and the error that stopped evaluation, if any;
        ``target_note`` when a target was set that does not fit the metric."""
        curve = self.curve.to_dict() if self.curve is not None else {
            "metric": None, "higher_is_better": None, "target": None, "target_reached": None,
            "time_to_target_s": None, "step_at_target": None, "samples_at_target": None, "evaluations": 0,
            "curve": []}
        out = {**curve, "eval_every_s": self.every_s, "target_accuracy": self.target_accuracy or None,
               "target_loss": self.target_loss or None, "skipped_busy": self.skipped_busy,
               "eval_time_s": summarize(self.eval_times_s), "error": self.error,
               "stopped_at_target": self.stopped_at_target}
        if self.curve is not None:
            unused = "target_loss" if self.curve.higher_is_better else "target_accuracy"
            if getattr(self, unused) > 0:
                out["target_note"] = (f"{unused} does not apply to the metric {self.curve.metric!r} "
                                      f"({'higher' if self.curve.higher_is_better else 'lower'} is better)")
        return out


def record_held_out(metrics: Any, evaluator: BackgroundEvaluator) -> None:
    """Put the evaluator's record into a node's metrics (`wiiide.metrics.NodeMetrics.extra`):
    ``held_out`` (`BackgroundEvaluator.to_dict`) and ``time_to_target_s`` (None: not reached)."""
    record = evaluator.to_dict()
    metrics.extra["held_out"] = record
    metrics.extra["time_to_target_s"] = record["time_to_target_s"]


def stop_at_target(cfg: Any, evaluator: BackgroundEvaluator | None) -> bool:
    """Whether training ends now because ``cfg.stop_at_target`` is on and `evaluator` saw the target
    reached (`BackgroundEvaluator.target_reached`); False without an evaluator. A True answer is final:
    the evaluator records ``stopped_at_target`` in its `to_dict`, so the caller must then stop."""
    if not (cfg.stop_at_target and evaluator is not None and evaluator.target_reached):
        return False
    evaluator.stopped_at_target = True
    return True


def evaluator_for(cfg: Any, build_model: Callable[[], nn.Module], data: Any) -> BackgroundEvaluator | None:
    """The node's evaluator when ``cfg.eval_every_s`` > 0 (a `wiiide.config.RunConfig`), else None.
    `build_model` makes a fresh model of the training model's architecture (the evaluator's own)."""
    if not cfg.eval_every_s > 0:
        return None
    return BackgroundEvaluator(build_model(), data, cfg.eval_every_s, cfg.target_accuracy, cfg.target_loss)
