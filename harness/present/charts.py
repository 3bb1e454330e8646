"""The report's charts (matplotlib, the Agg canvas through `Figure.savefig`; pyplot and its global
state are never imported), each returned as a PNG ``data:`` URI for the self-contained page.

- `metric_chart`: one `Totals` figure against the swept axis, every report of the page a series:
  median over the ok repeats, a bar from min to max, a dot per repeat, a red x for a point with no ok
  repeat, and the seeds' figures (`reference_figures`) where the spec's reference maps to the chart;
- `timeseries_chart`: one repeat's containers over the run (CPU, memory, network rate).
"""

from __future__ import annotations

import base64
import io
import math
import statistics
from dataclasses import dataclass
from typing import Any, Sequence

from harness.results.models import Point, Repeat, Report, Sample

try:  # the Agg canvas is used through Figure.savefig; pyplot (and its global state) is never imported
    from matplotlib.figure import Figure
except ImportError:  # pragma: no cover - pyproject.toml installs it
    Figure = None  # type: ignore[assignment,misc]

# (summary/totals key, chart title, y label, factor applied to the raw value)
CHART_METRICS = [
    ("batches_per_s", "Training speed", "batches/s (all workers)", 1.0),
    ("goodput_bytes_per_s", "Goodput through the parameter server", "MB/s (tensor bytes, both directions)", 1e-6),
    ("step_time_median_s", "Step time", "median step, ms", 1e3),
    ("worker_network_time_s", "Time in the network", "s per worker (send + receive)", 1.0),
    ("compression_ratio", "Compression ratio", "raw / encoded bytes", 1.0),
    ("test_accuracy", "Held-out accuracy", "%", 100.0),
    ("peak_rss_bytes", "Peak memory", "RSS of the largest node, MB", 1e-6),
    ("container_net_bytes", "Container traffic", "rx + tx of all containers, MB", 1e-6),
]
# Words of a reference's `metric` text, and the key of the figure it is compared with.
REFERENCE_METRICS = [("throughput", "goodput_bytes_per_s", 1e6), ("batches", "batches_per_s", 1.0)]
REFERENCE_FIELDS = {"batches_per_s": ("batches_per_s", 1.0), "throughput_MBps": ("goodput_bytes_per_s", 1e6),
                    "ratio": ("compression_ratio", 1.0)}
SERIES_MARKERS = "osD^vP*X"
FAILED_COLOR = "#c0392b"


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def param_text(value: Any) -> str:
    """An axis value as people read it: 512x512 for [512, 512], a variant's label for a mapping."""
    if isinstance(value, dict):
        return str(value["label"]) if "label" in value else "/".join(f"{k}={param_text(v)}" for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return "x".join(str(v) for v in value)
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def point_label(point: Point, names: Sequence[str]) -> str:
    """A point as ``name=value, ...`` over the axes `names`; ``(single point)`` when nothing is swept."""
    if not names:
        return "(single point)"
    return ", ".join(f"{n}={param_text(point.params.get(n))}" for n in names)


def _ok_values(point: Point, key: str) -> list[float]:
    return [v for v in point.values(key) if _finite(v)]


def _png(fig: Any) -> str:
    """The figure as a PNG ``data:`` URI (100 dpi, no Software tag, so the bytes do not vary by version)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, metadata={"Software": None})
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


class ChartLayout:
    """Where each point goes on the charts' x axis, and which series it belongs to.

    When every report sweeps the same axes, x is the first axis and each combination of the other axes
    (per report) is a series; otherwise x is the whole "name=value, ..." label and each report a series.
    """

    def __init__(self, reports: Sequence[tuple[str, Report]]) -> None:
        """Lay out `reports`, (label, report) pairs, in page order."""
        names = [r.axes for _, r in reports]
        self.shared = bool(names) and all(n == names[0] for n in names) and bool(names[0])
        self.x_name = names[0][0] if self.shared else "point"
        self.x_values: list[str] = []
        self.series: list[str] = []
        self.where: dict[tuple[int, int], tuple[str, str]] = {}  # (report #, point index) -> (x, series)
        for r_i, (label, report) in enumerate(reports):
            pnames = names[r_i]
            for point in report.points:
                params = point.params
                if self.shared:
                    x = param_text(params.get(pnames[0]))
                    rest = ", ".join(f"{n}={param_text(params.get(n))}" for n in pnames[1:])
                else:
                    x, rest = point_label(point, pnames), ""
                series = " | ".join(s for s in ((label if len(reports) > 1 else ""), rest) if s) or label
                if x not in self.x_values:
                    self.x_values.append(x)
                if series not in self.series:
                    self.series.append(series)
                self.where[(r_i, point.index)] = (x, series)


@dataclass(frozen=True)
class ReferenceFigure:
    """One of the seeds' figures from a spec's ``reference:`` block.

    `key`: the point value it is given for; `field`: its name when the entry has several (else None);
    `text`: as written; `value`: in the report's raw unit (bytes/s, batches/s) when numeric and mapped
    to a figure this harness measures, else None; `metric`: that figure's `Totals` name, else None;
    `point`: the point whose only swept value equals `key` (single-axis sweeps), else None.
    """

    key: str
    field: str | None
    text: str
    value: float | None
    metric: str | None
    point: Point | None


def reference_figures(report: Report) -> list[ReferenceFigure]:
    """The seeds' figures of a report's `reference` block, each matched to a point where one fits
    ([] when the spec has none). The seeds' units (MB/s, batches/s) are converted with `REFERENCE_FIELDS`."""
    ref = report.spec.reference
    values = ref.values
    if not isinstance(values, dict):
        return []
    metric_text = str(ref.metric or "").lower()
    default = next(((key, factor) for word, key, factor in REFERENCE_METRICS if word in metric_text), (None, 1.0))
    names = report.axes
    by_value = {}
    if len(names) == 1:
        by_value = {param_text(p.params.get(names[0])): p for p in report.points}
    rows = []
    for key, entry in values.items():
        fields = entry.items() if isinstance(entry, dict) else [(None, entry)]
        for field, raw in fields:
            metric, factor = REFERENCE_FIELDS.get(field, (None, 1.0)) if field else default
            value = raw * factor if (metric and _finite(raw)) else None
            rows.append(ReferenceFigure(str(key), field, str(raw), value, metric, by_value.get(str(key))))
    return rows


# ----------------------------------------------------------------------------------------------- charts

def metric_chart(key: str, title: str, ylabel: str, factor: float, layout: ChartLayout,
                  reports: Sequence[tuple[str, Report]]) -> str | None:
    """Median over ok repeats (marker, joined by a line), min-max bar, each repeat as a dot; failed
    points marked on the axis; the seeds' figures (hollow diamonds) where the reference maps to `key`."""
    xs = {x: i for i, x in enumerate(layout.x_values)}
    n_series = len(layout.series)
    width = 0.5 if n_series > 1 else 0.0
    offsets = {s: (i - (n_series - 1) / 2) * (width / max(n_series - 1, 1)) for i, s in enumerate(layout.series)}
    data: dict[str, list[tuple[float, list[float]]]] = {s: [] for s in layout.series}
    failed: list[tuple[float, str]] = []
    refs: list[list[tuple[float, float]]] = []
    for r_i, (_, report) in enumerate(reports):
        for point in report.points:
            x, series = layout.where[(r_i, point.index)]
            pos = xs[x] + offsets[series]
            values = [v * factor for v in _ok_values(point, key)]
            if values:
                data[series].append((pos, values))
            elif point.status in ("failed", "partial", "running"):
                failed.append((pos, point.status))
        mine = []
        for row in reference_figures(report):
            if row.metric == key and row.value is not None and row.point is not None:
                x, series = layout.where[(r_i, row.point.index)]
                mine.append((xs[x] + offsets[series], row.value * factor))
        if mine:
            refs.append(sorted(mine))
    if not any(data.values()):
        return None
    fig = Figure(figsize=(5.4, 3.4))
    ax = fig.add_subplot()
    colors = [f"C{i % 10}" for i in range(n_series)]
    for s_i, series in enumerate(layout.series):
        pts = sorted(data[series])
        if not pts:
            continue
        pos = [p for p, _ in pts]
        med = [statistics.median(v) for _, v in pts]
        lo = [med_i - min(v) for med_i, (_, v) in zip(med, pts)]
        hi = [max(v) - med_i for med_i, (_, v) in zip(med, pts)]
        color, marker = colors[s_i], SERIES_MARKERS[s_i % len(SERIES_MARKERS)]
        ax.errorbar(pos, med, yerr=[lo, hi], color=color, marker=marker, markersize=6, capsize=4, linewidth=1.4,
                    label=series if n_series > 1 else "median, min-max")
        shift = 0.07 if n_series == 1 else 0.0  # beside the bar, so that each repeat shows
        dots = [(p + shift, v) for p, vals in pts for v in vals]
        ax.plot([p for p, _ in dots], [v for _, v in dots], linestyle="none", marker=".", color=color, alpha=0.5,
                markersize=6)
    top = max(max(v) for pts in data.values() for _, v in pts)
    ax.set_ylim(0, top * 1.15 if top > 0 else 1.0)  # from zero, with room above the highest repeat
    handles, labels = ax.get_legend_handles_labels()
    if refs:
        # The seeds' figures share the axis when they are of the same order as ours; otherwise they get
        # their own (right) axis, so that their trend stays visible next to ours.
        ref_top = max(v for pts in refs for _, v in pts)
        own_axis = ref_top > 0 and not 0.2 <= top / ref_top <= 5
        if not own_axis:
            ax.set_ylim(0, max(top, ref_top) * 1.15)
        ref_ax = ax.twinx() if own_axis else ax
        for i, pts in enumerate(refs):
            line, = ref_ax.plot([p for p, _ in pts], [v for _, v in pts], linestyle=":", marker="D", markersize=7,
                                markerfacecolor="none", markeredgecolor="black", color="0.4",
                                label="seeds (right axis)" if own_axis else "seeds")
            if i == 0:
                handles.append(line)
                labels.append(line.get_label())
        if own_axis:
            ref_ax.set_ylim(0, ref_top * 1.25)
            ref_ax.set_ylabel("seeds' figure, same unit", fontsize=8, color="0.3")
            ref_ax.tick_params(labelsize=8, colors="0.3")
    for pos, status in failed:
        ax.plot([pos], [0], marker="x", color=FAILED_COLOR, markersize=9, mew=2, linestyle="none", clip_on=False)
        ax.annotate(status, (pos, 0), textcoords="offset points", xytext=(0, 8), ha="center", color=FAILED_COLOR,
                    fontsize=8)
    ax.set_xticks(range(len(layout.x_values)))
    ax.set_xticklabels(layout.x_values, rotation=0 if sum(len(x) for x in layout.x_values) < 60 else 25,
                       ha="center" if sum(len(x) for x in layout.x_values) < 60 else "right", fontsize=9)
    ax.set_xlim(-0.6, len(layout.x_values) - 0.4)
    ax.set_xlabel(layout.x_name)
    ax.set_ylabel(ylabel, fontsize=9)
    ax.set_title(title, fontsize=11)
    ax.grid(axis="y", alpha=0.3)
    if n_series > 1 or refs:
        ax.legend(handles, labels, fontsize=8, loc="best")
    fig.tight_layout()
    return _png(fig)


def representative_repeat(point: Point) -> Repeat | None:
    """The ok repeat with the median batches/s (the one to look at), else the last repeat with samples,
    else None."""
    ok = sorted(point.ok_repeats, key=lambda r: r.totals.batches_per_s or 0)
    if ok:
        return ok[(len(ok) - 1) // 2]
    with_samples = [r for r in point.repeats if any(c.samples for c in r.containers.values())]
    return with_samples[-1] if with_samples else None


def _series_of(samples: list[Sample]) -> dict[str, tuple[list[float], list[float]]]:
    """t and CPU %, memory MB and network rx+tx MB/s (from the counters' differences) of one container."""
    samples = sorted((s for s in samples if _finite(s.t_s)), key=lambda s: s.t_s)
    out: dict[str, tuple[list[float], list[float]]] = {}
    cpu = [(s.t_s, s.cpu_percent) for s in samples if _finite(s.cpu_percent)]
    mem = [(s.t_s, s.memory_bytes / 1e6) for s in samples if _finite(s.memory_bytes)]
    net = [(s.t_s, s.net_rx_bytes + s.net_tx_bytes) for s in samples
           if _finite(s.net_rx_bytes) and _finite(s.net_tx_bytes)]
    rate = [((t0 + t1) / 2, (b1 - b0) / (t1 - t0) / 1e6) for (t0, b0), (t1, b1) in zip(net, net[1:]) if t1 > t0]
    for name, pairs in (("cpu", cpu), ("mem", mem), ("net", rate)):
        if pairs:
            out[name] = ([p[0] for p in pairs], [p[1] for p in pairs])
    return out


TIME_PANELS = [("cpu", "CPU (% of one core)"), ("mem", "memory without page cache (MB)"),
               ("net", "network rx+tx (MB/s)")]


def timeseries_limits(reports: Sequence[tuple[str, Report]]) -> dict[str, tuple[float, float]]:
    """Shared y (per panel: ``cpu``, ``mem``, ``net``) and x (``t``) limits over every point drawn, so
    the points compare at a glance: (0, 108 % of the highest value), or (0, 1) when nothing is drawn."""
    top = {name: 0.0 for name, _ in TIME_PANELS}
    t_max = 0.0
    for _, report in reports:
        for point in report.points:
            rep = representative_repeat(point)
            for c in (rep.containers.values() if rep else ()):
                for name, (t, y) in _series_of(c.samples).items():
                    top[name] = max(top[name], max(y))
                    t_max = max(t_max, max(t))
    limits = {name: (0.0, value * 1.08 or 1.0) for name, value in top.items()}
    limits["t"] = (0.0, t_max * 1.02 or 1.0)
    return limits


def timeseries_chart(rep: Repeat, limits: dict[str, tuple[float, float]], title: str) -> str | None:
    """One repeat's containers over time, three panels (CPU % of one core, memory MB, network MB/s),
    on the shared `limits` (`timeseries_limits`): a PNG ``data:`` URI, or None without samples."""
    containers = rep.containers
    series = {name: _series_of(c.samples) for name, c in sorted(containers.items())}
    if not any(series.values()):
        return None
    fig = Figure(figsize=(11.2, 2.7))
    axes = fig.subplots(1, 3)
    workers = 0
    styles = {}
    for name, c in sorted(containers.items()):
        if c.role == "coordinator" or "coordinator" in name:
            styles[name] = {"color": "black", "linewidth": 1.8}
        else:
            styles[name] = {"color": f"C{workers % 10}", "linewidth": 1.1}
            workers += 1
    for ax, (panel, ylabel) in zip(axes, TIME_PANELS):
        drawn = False
        for name, s in series.items():
            if panel in s:
                t, y = s[panel]
                ax.plot(t, y, label=name, **styles[name])
                drawn = True
        if not drawn:
            ax.text(0.5, 0.5, "not sampled on this backend" if panel == "net" else "no samples",
                    ha="center", va="center", transform=ax.transAxes, color="0.4", fontsize=9)
        ax.set_ylim(*limits[panel])
        ax.set_xlim(*limits["t"])
        ax.set_title(ylabel, fontsize=10)
        ax.set_xlabel("s since the run started", fontsize=8)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    if not handles:
        handles, labels = axes[1].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper right", ncol=min(len(handles), 6) or 1, fontsize=7, frameon=False)
    fig.suptitle(title, fontsize=10, x=0.01, ha="left")
    fig.tight_layout()
    return _png(fig)


# ------------------------------------------------------------------------- held-out metric over time

# metric name -> (y label, factor applied to the value)
HELD_OUT_AXES = {"accuracy": ("held-out accuracy, %", 100.0)}


def held_out_metrics(reports: Sequence[tuple[str, Report]]) -> list[str]:
    """The held-out metrics (``accuracy``, ``validation_loss``...) of the repeats of `reports` that
    evaluated during training, in order of first appearance."""
    names: list[str] = []
    for _, report in reports:
        for point in report.points:
            for rep in point.repeats:
                if rep.held_out is not None and rep.held_out.curve and rep.held_out.metric not in names:
                    names.append(str(rep.held_out.metric))
    return names


def held_out_chart(metric: str, reports: Sequence[tuple[str, Report]]) -> str | None:
    """The held-out `metric` against wall time since training started, every point of every report a
    line of its own colour (its ok repeats; the representative one, `representative_repeat`, drawn
    solid and the others faint), each target a dashed line and each first crossing a star, so that
    points compare on quality and speed at once. A PNG ``data:`` URI, or None when no repeat has a
    curve of `metric`."""
    ylabel, factor = HELD_OUT_AXES.get(metric, (f"held-out {metric.replace('_', ' ')}", 1.0))
    lines = []  # (label, [(repeat, is representative)])
    for label, report in reports:
        for point in report.points:
            reps = [r for r in (point.ok_repeats or point.repeats)
                    if r.held_out is not None and r.held_out.metric == metric and r.held_out.curve]
            if not reps:
                continue
            main = representative_repeat(point)
            name = point_label(point, report.axes)
            lines.append((f"{label}: {name}" if len(reports) > 1 else f"{point.index}: {name}",
                          [(r, r is main or (main not in reps and r is reps[0])) for r in reps]))
    if not lines:
        return None
    fig = Figure(figsize=(8.0, 3.8))
    ax = fig.add_subplot()
    targets: set[float] = set()
    for i, (label, reps) in enumerate(lines):
        color = f"C{i % 10}"
        for rep, is_main in sorted(reps, key=lambda item: item[1]):  # the representative drawn last, on top
            held = rep.held_out
            ax.plot([p.t_s for p in held.curve], [p.value * factor for p in held.curve], color=color,
                    linewidth=1.6 if is_main else 0.9, alpha=1.0 if is_main else 0.35,
                    marker="." if is_main else None, markersize=4, label=label if is_main else None)
            if held.target is not None:
                targets.add(held.target)
            if held.time_to_target_s is not None:
                hit = next((p for p in held.curve if p.t_s == held.time_to_target_s), None)
                if hit is not None:
                    ax.plot([hit.t_s], [hit.value * factor], marker="*", markersize=11 if is_main else 7,
                            color=color, markeredgecolor="black", linestyle="none", alpha=1.0 if is_main else 0.5)
    for target in sorted(targets):
        ax.axhline(target * factor, color="0.3", linestyle="--", linewidth=1)
        ax.annotate(f"target {target * factor:g}", (0, target * factor), xycoords=("axes fraction", "data"),
                    textcoords="offset points", xytext=(4, 3), fontsize=8, color="0.3")
    ax.set_xlabel("s since training started (wall time)")
    ax.set_ylabel(ylabel, fontsize=9)
    ax.set_title(f"Held-out {metric.replace('_', ' ')} against wall time (star: target first reached)", fontsize=11)
    ax.set_xlim(left=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    return _png(fig)
