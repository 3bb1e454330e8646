"""``harness compare A.json [B.json]``: engines (or two reports) side by side, with ratios and significance.

One report with an ``engine`` axis: points are grouped by every other parameter (link, worker count,
model...) and each engine is set against a baseline engine of the same group (``ddp`` by default).
Two reports: points with the same parameters are set against each other (B over A).
With ``--pool AXIS`` (one report), the points that differ only in that axis (seeds, say) count as one:
their repeats are pooled into one sample, so an engine's five seeds are set against the baseline's five.

A ratio is called significant only when Welch's t-test over the repeats (unequal variances,
``scipy.stats.ttest_ind(equal_var=False)``) gives p below ``alpha`` (0.05): a "1.3x faster" read from
noise is marked as such. Fewer than two repeats on either side: no test ("n<2").
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from harness.errors import HarnessError
from harness.present.table import has_targets, render_table, report_title, target_cell
from harness.present.time_to_train import mlperf_cell, point_time_to_train
from harness.results.models import Point, Report
from harness.results.report import as_report, load_report
from wiiide.metrics import write_json_atomic

ENGINE_PARAM = "engine"
DEFAULT_METRIC = "throughput_samples_per_s"
DEFAULT_BASELINE = "ddp"
ALPHA = 0.05


@dataclass
class Side:
    """One point's raw values of a metric over its ok repeats, and their statistics."""

    label: str
    values: list[float]

    @property
    def n(self) -> int:
        """How many repeats carry the metric."""
        return len(self.values)

    @property
    def mean(self) -> float | None:
        """Their mean, in the metric's unit; None without values."""
        return statistics.fmean(self.values) if self.values else None

    @property
    def stdev(self) -> float | None:
        """Their sample standard deviation (n - 1), in the metric's unit; None below two values."""
        return statistics.stdev(self.values) if len(self.values) > 1 else None


@dataclass
class Row:
    """A point set against its reference: ratio of means (point / reference) and Welch's t-test."""

    group: dict[str, Any]
    label: str
    reference: str
    n: int
    mean: float | None
    stdev: float | None
    ref_mean: float | None
    ratio: float | None
    p_value: float | None
    significant: bool | None  # None: no test possible
    extra: dict[str, float | None]
    to_target: str = "-"  # time to target, s (`harness.present.table.target_cell`): median, "(k/n)", "not reached"
    mlperf: str = "-"  # MLPerf's reading of it (`harness.present.time_to_train.mlperf_cell`)

    def to_dict(self) -> dict[str, Any]:
        """The row as a JSON-ready dict (the ``--json`` output)."""
        return asdict(self)


def welch_p_value(a: Sequence[float], b: Sequence[float]) -> float | None:
    """Two-sided p-value of Welch's t-test between samples `a` and `b`.

    None when either has fewer than two values. When both have zero variance the test is undefined:
    p is 1.0 if the means are equal and 0.0 if they differ (no spread at all separates them).
    """
    if len(a) < 2 or len(b) < 2:
        return None
    if statistics.pstdev(a) == 0 and statistics.pstdev(b) == 0:
        return 1.0 if statistics.fmean(a) == statistics.fmean(b) else 0.0
    from scipy.stats import ttest_ind

    p = float(ttest_ind(list(a), list(b), equal_var=False).pvalue)
    return None if math.isnan(p) else p


def _params_key(params: Mapping[str, Any]) -> str:
    """A hashable, order-free key of a point's params (values that are not JSON as their str)."""
    return json.dumps(params, sort_keys=True, default=str)


def _values(point: Point, metric: str) -> list[float]:
    return [float(v) for v in point.values(metric)]


def _mean_of(point: Point, key: str) -> float | None:
    values = _values(point, key)
    return statistics.fmean(values) if values else None


EXTRA_KEYS = ("test_accuracy", "comm_share", "comm_expected_bytes_per_step", "comm_measured_bytes_per_step",
              "time_to_target_s")


def _row(group: dict[str, Any], label: str, point: Point, ref_label: str, ref: Point,
         metric: str, alpha: float) -> Row:
    side, ref_side = Side(label, _values(point, metric)), Side(ref_label, _values(ref, metric))
    p = welch_p_value(side.values, ref_side.values)
    ratio = (side.mean / ref_side.mean) if (side.mean is not None and ref_side.mean) else None
    return Row(group, label, ref_label, side.n, side.mean, side.stdev, ref_side.mean, ratio, p,
               None if p is None else p < alpha, {k: _mean_of(point, k) for k in EXTRA_KEYS}, target_cell(point),
               mlperf_cell(point_time_to_train(point, ref)))


def pool_points(report: Report, axis: str) -> Report:
    """`report` with the points that differ only in `axis` merged into one: its params without `axis`,
    the repeats of every merged point in the report's order, and ``status`` ``ok`` only when every merged
    point is ok (else ``partial``). The merged point's summary is left empty: the comparison reads the
    repeats.

    Raises HarnessError when `axis` is not one of the report's params.
    """
    if axis not in report.param_names:
        raise HarnessError(f"report '{report.name}' has no '{axis}' axis to pool over "
                           f"(params: {list(report.param_names)})")
    merged: dict[str, Point] = {}
    for point in report.points:
        params = {k: v for k, v in point.params.items() if k != axis}
        key = _params_key(params)
        if key not in merged:
            merged[key] = point.model_copy(update={"params": params, "repeats": list(point.repeats),
                                                   "summary": {}, "unstable": []})
            continue
        into = merged[key]
        into.repeats = [*into.repeats, *point.repeats]
        if point.status != "ok" or into.status != "ok":
            into.status = "partial"
    names = [n for n in report.param_names if n != axis]
    return report.model_copy(update={"points": list(merged.values()), "param_names": names})


def compare_engines(report: Report | Mapping[str, Any], metric: str = DEFAULT_METRIC, baseline: str | None = None,
                    alpha: float = ALPHA) -> list[Row]:
    """Each engine against the baseline engine of its group (all other params equal): `baseline`, else
    ``ddp`` when the report has it, else each group's first engine; `metric`: a
    `Totals` figure, compared over the ok repeats; `alpha`: the t-test's significance level. A group
    without the baseline (a sweep stopped before its baseline ran) is left out (`engine_rows` names it).

    Raises HarnessError when the report has no ``engine`` axis or the baseline is in no group.
    """
    return engine_rows(report, metric, baseline, alpha)[0]


def engine_rows(report: Report | Mapping[str, Any], metric: str = DEFAULT_METRIC, baseline: str | None = None,
                alpha: float = ALPHA, pool: str | None = None) -> tuple[list[Row], list[str]]:
    """`compare_engines`'s rows, and a line for each group left out because its baseline did not run;
    with `pool`, over `pool_points(report, pool)`.

    Raises HarnessError when the report has no ``engine`` axis, no `pool` axis, or the baseline is in no group.
    """
    report = as_report(report)
    if pool is not None:
        if pool == ENGINE_PARAM:
            raise HarnessError(f"cannot pool over '{ENGINE_PARAM}': the engines are what is compared")
        report = pool_points(report, pool)
    params = list(report.param_names)
    if ENGINE_PARAM not in params:
        raise HarnessError(f"report '{report.name}' has no '{ENGINE_PARAM}' axis (params: {params}); "
                           "give two reports to compare them point by point")
    others = [p for p in params if p != ENGINE_PARAM]
    groups: dict[str, tuple[dict[str, Any], dict[str, Point]]] = {}
    for point in report.points:
        group = {k: point.params.get(k) for k in others}
        key = _params_key(group)
        groups.setdefault(key, (group, {}))[1][str(point.params[ENGINE_PARAM])] = point
    rows: list[Row] = []
    skipped: list[str] = []
    if baseline is None and any(DEFAULT_BASELINE in by_engine for _, by_engine in groups.values()):
        baseline = DEFAULT_BASELINE
    for group, by_engine in groups.values():
        ref_label = baseline or next(iter(by_engine))
        if ref_label not in by_engine:
            skipped.append(f"not compared: baseline engine '{ref_label}' is not in group {group} "
                           f"(engines: {', '.join(by_engine)})")
            continue
        for label, point in by_engine.items():
            rows.append(_row(group, label, point, ref_label, by_engine[ref_label], metric, alpha))
    if not rows and skipped:
        raise HarnessError(skipped[0].removeprefix("not compared: "))
    return rows, skipped


def compare_reports(a: Report | Mapping[str, Any], b: Report | Mapping[str, Any], metric: str = DEFAULT_METRIC,
                    alpha: float = ALPHA) -> tuple[list[Row], list[str]]:
    """Every point of B against the point of A with the same params (ratio B / A); also the params
    found in one report only (``only in A: {...}``). Raises HarnessError if either is not a report."""
    a_points = {_params_key(p.params): p for p in as_report(a).points}
    rows, unmatched = [], []
    for point in as_report(b).points:
        ref = a_points.pop(_params_key(point.params), None)
        if ref is None:
            unmatched.append(f"only in B: {point.params}")
            continue
        rows.append(_row(dict(point.params), "B", point, "A", ref, metric, alpha))
    unmatched += [f"only in A: {p.params}" for p in a_points.values()]
    return rows, unmatched


def _num(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.0f}" if abs(value) >= 100 else f"{value:.3g}"


def verdict(row: Row, alpha: float = ALPHA) -> str:
    """``1.32x (p=0.004)`` when significant, ``~1.05x ns (p=0.41)`` when not, ``n<2`` with no test."""
    if row.ratio is None:
        return "-"
    if row.label == row.reference:
        return "baseline"
    if row.p_value is None:
        return f"{row.ratio:.2f}x n<2"
    if row.significant:
        return f"{row.ratio:.2f}x (p={row.p_value:.2g})"
    return f"~{row.ratio:.2f}x ns (p={row.p_value:.2g})"


def format_rows(rows: list[Row], metric: str, title: str, alpha: float = ALPHA, targets: bool = False) -> str:
    """Rows as a text table: group params, label, n, mean ± stdev, verdict against the reference,
    accuracy (%), communication share (%), expected and measured MB per step (1 MB = 1e6 bytes), and
    with `targets` the time to target (s, `Row.to_target`)."""
    group_keys = list(rows[0].group) if rows else []
    header = [*group_keys, "engine", "n", f"{metric} mean±sd", "vs", "ratio (Welch)", "acc %", "comm %",
              "exp MB/step", "meas MB/step", *(["to target s", "MLPerf s"] if targets else [])]
    table = []
    for r in rows:
        sd = f"±{_num(r.stdev)}" if r.stdev is not None else ""
        acc, share = r.extra.get("test_accuracy"), r.extra.get("comm_share")
        exp_b, meas_b = r.extra.get("comm_expected_bytes_per_step"), r.extra.get("comm_measured_bytes_per_step")
        table.append([*(str(r.group[k]) for k in group_keys), r.label, r.n, f"{_num(r.mean)}{sd}",
                      r.reference, verdict(r, alpha),
                      "-" if acc is None else f"{100 * acc:.1f}", "-" if share is None else f"{100 * share:.0f}",
                      "-" if exp_b is None else f"{exp_b / 1e6:.3g}", "-" if meas_b is None else f"{meas_b / 1e6:.3g}",
                      *([r.to_target, r.mlperf] if targets else [])])
    legend = (f"ratio: mean / reference mean; significant when Welch's t-test p < {alpha:g} over the repeats, "
              "'~... ns' otherwise; comm %: share of step time communicating; MB/step: expected from the "
              "model size vs measured on the nodes' interfaces (docker backend)")
    target_legend = ["to target s: wall time to the first held-out evaluation reaching the target, median over "
                     "the repeats that reached it, (k/n) when only k of n did; --metric time_to_target_s tests it",
                     "MLPerf s: mean after dropping the fastest and slowest repeat (a repeat that never reached the "
                     "target counts as slowest; more than one makes it invalid), [median, 95 % bootstrap CI of the "
                     "mean], runs outside the reference's fastest..slowest flagged"]
    return render_table(title, header, table, footer=[legend, *(target_legend if targets else [])])


def compare(paths: Sequence[str], metric: str = DEFAULT_METRIC, baseline: str | None = None,
            alpha: float = ALPHA, json_path: str | None = None, pool: str | None = None) -> str:
    """The table for one report (engines against the baseline, with `pool` over `pool_points`) or two
    (B against A); optionally as JSON too, written atomically to `json_path` ({reports, metric, alpha,
    pool, rows, unmatched}).

    Raises HarnessError (unreadable report, no engine axis, unknown baseline or pool axis, `pool` with two
    reports, no common point, no ok repeat carrying `metric`).
    """
    if not 1 <= len(paths) <= 2:
        raise HarnessError(f"compare takes one or two reports, got {len(paths)}")
    if pool is not None and len(paths) != 1:
        raise HarnessError("--pool works on one report (its engines against the baseline)")
    reports = [load_report(p) for p in paths]
    unmatched: list[str] = []
    if len(reports) == 1:
        rows, unmatched = engine_rows(reports[0], metric, baseline, alpha, pool)
        title = report_title(reports[0]) + (f"\npooled over {pool}: each engine's repeats of every {pool}"
                                            if pool else "")
    else:
        rows, unmatched = compare_reports(reports[0], reports[1], metric, alpha)
        if not rows:
            raise HarnessError("the two reports share no point (no equal params); nothing to compare")
        title = f"A: {report_title(reports[0])}\nB: {report_title(reports[1])}"
    if not any(r.n for r in rows):
        raise HarnessError(f"no ok repeat carries '{metric}'; is it a key of the repeats' totals?")
    if json_path:
        write_json_atomic(Path(json_path), {"reports": [str(p) for p in paths], "metric": metric, "alpha": alpha,
                                             "pool": pool, "rows": [r.to_dict() for r in rows], "unmatched": unmatched})
    targets = any(has_targets(r) for r in reports)
    return "\n".join([format_rows(rows, metric, title, alpha, targets), *unmatched])
