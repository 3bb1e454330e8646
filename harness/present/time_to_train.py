"""Time to train as MLPerf Training reports it, over a point's repeats.

MLPerf Training's rules (``training_rules.adoc``, "Benchmark Results"): a benchmark is run several times
(5 or 10 by benchmark); the fastest and the slowest result are dropped and the rest averaged (the
"olympic" mean); at most one run may fail to reach the target (it counts as the slowest, so it is the
one dropped); and a run whose convergence is far from the reference's (``reference convergence points``)
is suspect. Here, beside that figure: the median of the runs that converged and a bootstrap confidence
interval of their mean (``scipy.stats.bootstrap``, BCa, fixed seed so that a report reads the same twice).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Sequence

import numpy as np
from scipy import stats

MAX_NOT_CONVERGED = 1
MLPERF_LEGEND = ("MLPerf s: time to target as MLPerf Training reports it: the mean after dropping the fastest and "
                 "the slowest repeat (a repeat that never reached the target counts as slowest; more than one "
                 "makes the point invalid), [median, 95 % bootstrap CI of the mean]")
CONFIDENCE_LEVEL = 0.95
BOOTSTRAP_RESAMPLES = 2000
BOOTSTRAP_SEED = 0


@dataclass(frozen=True)
class TimeToTrain:
    """The MLPerf-style reading of one point's times to target (seconds).

    Attributes:
        runs: repeats judged (with a target); converged: how many reached it; not_converged: the rest.
        olympic_mean_s: the mean after dropping the fastest and the slowest run (a run that did not
            converge counts as the slowest); None with fewer than 3 runs or more than one not converged.
        valid: at most `MAX_NOT_CONVERGED` run did not converge and there are at least 3 runs.
        median_s: the median of the converged runs; ci_low_s, ci_high_s: the bootstrap confidence
            interval (level `CONFIDENCE_LEVEL`) of their mean; None with fewer than 2 distinct values.
        outside_reference: indices (in the given order) of converged runs outside the reference range.
    """

    runs: int
    converged: int
    not_converged: int
    olympic_mean_s: float | None
    valid: bool
    median_s: float | None
    ci_low_s: float | None
    ci_high_s: float | None
    outside_reference: tuple[int, ...]


def time_to_train(times_s: Sequence[float | None],
                  reference_range_s: tuple[float, float] | None = None) -> TimeToTrain:
    """Read `times_s` (one per repeat, None for a repeat that never reached the target) as MLPerf does.

    `reference_range_s`: (low, high) seconds a converged run is expected in (e.g. the reference
    engine's fastest and slowest run); runs outside it are listed in ``outside_reference``.

    Raises:
        ValueError: a negative or non-finite time, or a reference range with low > high.
    """
    converged = [float(t) for t in times_s if t is not None]
    if any(not math.isfinite(t) or t < 0 for t in converged):
        raise ValueError(f"times to target must be finite seconds >= 0, got {list(times_s)}")
    if reference_range_s is not None and reference_range_s[0] > reference_range_s[1]:
        raise ValueError(f"reference range {reference_range_s}: low above high")
    runs, failed = len(times_s), len(times_s) - len(converged)
    valid = runs >= 3 and failed <= MAX_NOT_CONVERGED
    olympic = None
    if valid:
        ordered = sorted(converged) + [math.inf] * failed
        olympic = statistics.fmean(ordered[1:-1])
    low = high = None
    if len(set(converged)) >= 2:
        result = stats.bootstrap((np.asarray(converged),), np.mean, confidence_level=CONFIDENCE_LEVEL,
                                 n_resamples=BOOTSTRAP_RESAMPLES, method="BCa",
                                 random_state=np.random.default_rng(BOOTSTRAP_SEED))
        low, high = float(result.confidence_interval.low), float(result.confidence_interval.high)
    outside: tuple[int, ...] = ()
    if reference_range_s is not None:
        outside = tuple(i for i, t in enumerate(times_s)
                        if t is not None and not reference_range_s[0] <= t <= reference_range_s[1])
    return TimeToTrain(runs, len(converged), failed, olympic, valid,
                       statistics.median(converged) if converged else None, low, high, outside)


def point_times_s(point) -> list[float | None]:
    """A point's times to target (`harness.results.models.Point`): one per ok repeat that had a target,
    in repeat order, None for a repeat that did not reach it."""
    return [r.totals.time_to_target_s if r.totals.target_reached else None
            for r in point.ok_repeats if r.totals.target_reached is not None]


def point_time_to_train(point, reference=None) -> TimeToTrain | None:
    """`time_to_train` of a point's repeats, the reference range being the fastest and slowest converged
    run of `reference` (another point, e.g. the compared engine's; None or itself: no range). None when
    no ok repeat had a target."""
    times = point_times_s(point)
    if not times:
        return None
    ref = [t for t in point_times_s(reference) if t is not None] if reference not in (None, point) else []
    return time_to_train(times, (min(ref), max(ref)) if ref else None)


def mlperf_cell(reading: TimeToTrain | None) -> str:
    """``12.3 [med 12.1, CI 11.0-13.5]`` with `` 1 not conv.`` and `` 2 outside ref!`` when so; ``invalid
    (2/5 not conv.)`` past MLPerf's one allowed failure; ``-`` without a target."""
    if reading is None:
        return "-"
    if not reading.valid:
        return (f"invalid ({reading.not_converged}/{reading.runs} not conv.)" if reading.runs >= 3
                else f"- ({reading.runs} run(s), MLPerf needs >= 3)")
    ci = (f", CI {reading.ci_low_s:.3g}-{reading.ci_high_s:.3g}" if reading.ci_low_s is not None else "")
    text = f"{reading.olympic_mean_s:.3g} [med {reading.median_s:.3g}{ci}]"
    if reading.not_converged:
        text += f" {reading.not_converged} not conv."
    if reading.outside_reference:
        text += f" {len(reading.outside_reference)} outside ref!"
    return text
