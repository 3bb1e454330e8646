"""Sweep reports as one self-contained HTML page: charts (`harness.present.charts`, PNG embedded as
base64), the table, failures with their errors, the seeds' figures, and each point's per-container
time series.

The page is the Jinja2 template ``templates/report.html.j2`` with autoescape on: this module only
gathers the values (text, numbers formatted as the text table formats them, ``data:`` URIs) and the
template writes the markup, so every value from a report is escaped. The page loads nothing: every
image is a ``data:`` URI, the style is inline, there is no script, and a Content-Security-Policy
forbids any other source, so it reads the same offline, attached to a mail or opened from a CI artefact.

``render_page([(label, report), ...])`` returns the page; with several reports the charts put them on
the same axes (one series each) for comparison. ``write_html(paths)`` loads report.json files and
writes the page: ``<report folder>/report.html`` for one report, ``<first report folder>/compare-<other
folders>.html`` for several (or ``out``).
"""

from __future__ import annotations

import math
import re
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import jinja2

from harness.errors import HarnessError
from harness.present.charts import (
    CHART_METRICS,
    FAILED_COLOR,
    ChartLayout,
    Figure,
    held_out_chart,
    held_out_metrics,
    metric_chart,
    param_text,
    point_label,
    reference_figures,
    representative_repeat,
    timeseries_chart,
    timeseries_limits,
)
from harness.present.table import (
    TARGET_LEGEND,
    VS_BASELINE_LEGEND,
    baseline_cells,
    baseline_columns,
    format_value,
    has_targets,
    stats_cell,
    table_columns,
)
from harness.present.time_to_train import MLPERF_LEGEND, mlperf_cell, point_time_to_train
from harness.results.models import Point, Report
from harness.results.report import as_report, load_report
from wiiide.metrics import write_text_atomic

__all__ = ["CHART_METRICS", "default_html_path", "reference_figures", "render_page", "report_label",
           "socket_buffers", "write_html"]

TEMPLATE = "report.html.j2"


@lru_cache(maxsize=1)
def _environment() -> jinja2.Environment:
    return jinja2.Environment(loader=jinja2.PackageLoader("harness.present", "templates"), autoescape=True,
                              trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True, undefined=jinja2.StrictUndefined)


def _mib(n: Any) -> str:
    return f"{n / 2**20:g}" if isinstance(n, (int, float)) and math.isfinite(n) else "?"


def socket_buffers(point: Point) -> str | None:
    """SO_SNDBUF/SO_RCVBUF as requested and as the kernel set them (MiB), from the coordinator's
    sockets over the point's repeats: ``1 → 2 MiB``, or ``snd 1 → 2, rcv 4 → 8 MiB``; None if unknown."""
    seen: list[str] = []
    for rep in point.repeats:
        for opt in (rep.nodes.get("coordinator") or {}).get("socket_options") or []:
            snd = f"{_mib(opt.get('sndbuf_requested_bytes'))} → {_mib(opt.get('sndbuf_bytes'))}"
            rcv = f"{_mib(opt.get('rcvbuf_requested_bytes'))} → {_mib(opt.get('rcvbuf_bytes'))}"
            text = f"{snd} MiB" if snd == rcv else f"snd {snd}, rcv {rcv} MiB"
            if text not in seen:
                seen.append(text)
    return "; ".join(seen) or None


def _short_error(point: Point, limit: int = 160) -> str | None:
    """The first line of each failed repeat's error, cut at `limit`; the whole text is under Failures."""
    bad = [r for r in point.repeats if not r.ok]
    if not bad and not point.error:
        return None
    lines = [f"repeat {r.repeat}: " + (str(r.error or r.status).strip().splitlines() or [""])[0] for r in bad] \
        or [str(point.error).splitlines()[0]]
    text = "; ".join(dict.fromkeys(lines))
    return text if len(text) <= limit else text[:limit - 1] + "…"


def _meta(label: str, report: Report, heading: str) -> dict[str, Any]:
    backend, machine, commit, spec = report.backend, report.machine_info, report.commit_info, report.spec
    backend_text = backend.name
    if backend.engine_version:
        backend_text += f" (engine {backend.engine_version}, {backend.compose_version or backend.compose or ''})"
    return {
        "label": label, "heading": heading, "description": spec.description, "backend": backend_text,
        "cpus": machine.cpu_count_logical or "?",
        "cpu_model": ", ".join(x for x in (machine.cpu_model, machine.cpu_signature) if x) or "?",
        "memory_gib": f"{(machine.memory_total_bytes or 0) / 2**30:.0f}", "kernel": machine.kernel or "?",
        "rmem_max": "?" if machine.rmem_max_bytes is None else machine.rmem_max_bytes,
        "commit": (commit.id or "?")[:10], "dirty": bool(commit.dirty),
        "created": report.created_at_utc or "?", "updated": report.updated_at_utc or "?",
        "repeats_per_point": "?" if spec.repeats is None else spec.repeats,
        "incomplete": None if report.complete else (report.note or "the sweep has not finished (or was stopped)"),
        "n_points": len(report.points),
        "axes": [(k, ", ".join(param_text(v) for v in vs)) for k, vs in spec.axes.items()],
        "base": ", ".join(f"{k}={param_text(v)}" for k, v in spec.base.items()),
    }


def _table(report: Report) -> dict[str, Any]:
    params = report.axes
    buffers = {p.index: socket_buffers(p) for p in report.points}
    show_buffers = any(buffers.values())
    columns = table_columns(report)
    targets = has_targets(report)
    versus = baseline_cells(report)
    head = ["#", *params, "status", "n ok", *baseline_columns(report), *[c[0] for c in columns],
            *(["MLPerf s"] if targets else []),
            *(["socket buffers, requested → effective"] if show_buffers else []), "error"]
    text_columns = {*params, "status", "error"}
    rows = [{"index": p.index, "status": p.status, "params": [param_text(p.params.get(n)) for n in params],
             "n_ok": f"{len(p.ok_repeats)}/{len(p.repeats)}",
             "cells": [*versus.get(p.index, []), *(stats_cell(p, key, kind, sep=" ") for _, key, kind in columns),
                       *([mlperf_cell(point_time_to_train(p))] if targets else [])],
             "buffers": buffers[p.index] or "-", "error": _short_error(p)} for p in report.points]
    return {"head": [(h, h in text_columns) for h in head], "rows": rows, "show_buffers": show_buffers,
            "target_note": ". ".join([*([f"{TARGET_LEGEND}. {MLPERF_LEGEND}"] if targets else []),
                                      *([VS_BASELINE_LEGEND] if versus else [])]) or None}


def _failures(report: Report) -> list[dict[str, Any]]:
    items = []
    for point in report.points:
        bad = [r for r in point.repeats if not r.ok]
        if not bad and point.status in ("ok", "running"):
            continue
        items.append({"index": point.index, "label": point_label(point, report.axes), "status": point.status,
                      # the point's error joins its repeats' ones: shown only when no repeat says more
                      "error": None if bad else (point.error or ""),
                      "repeats": [{"repeat": r.repeat, "status": r.status,
                                   "error": r.error or "(no error recorded)"} for r in bad]})
    return items


def _reference(report: Report) -> dict[str, Any] | None:
    rows = reference_figures(report)
    if not rows:
        return None
    ref = report.spec.reference
    charts = {key: (title, unit, factor) for key, title, unit, factor in CHART_METRICS}
    first_measured: dict[str | None, float] = {}
    first_seed: dict[str | None, float] = {}
    out = []
    for row in rows:
        title, unit, factor = charts.get(row.metric or "", (None, "", 1.0))
        stats = row.point.summary.get(row.metric) if (row.point is not None and row.metric) else None
        measured = stats.median if stats else None
        measured_text = (f"{measured * factor:.3g}" if measured is not None
                         else "no matching point" if row.point is None else "-")
        rel_seed = rel_meas = "-"
        if row.value is not None and measured is not None:
            first_seed.setdefault(row.metric, row.value)
            first_measured.setdefault(row.metric, measured)
            rel_seed = f"{row.value / first_seed[row.metric]:.2f}x"
            rel_meas = f"{measured / first_measured[row.metric]:.2f}x"
        out.append({"key": row.key, "field": row.field or ref.metric or "", "seeds": row.text,
                    "compared": f"{title} ({unit})" if title else "not measured here", "measured": measured_text,
                    "rel_seed": rel_seed, "rel_meas": rel_meas})
    return {"source": ref.source or "?", "metric": ref.metric or "?", "rows": out}


def _timeseries(report: Report, limits: dict[str, tuple[float, float]]) -> list[dict[str, Any]]:
    figures = []
    for point in report.points:
        label = f"point {point.index}: {point_label(point, report.axes)} ({point.status})"
        rep = representative_repeat(point)
        uri = timeseries_chart(rep, limits, f"{label}, repeat {rep.repeat} ({rep.status})") if rep else None
        figures.append({"uri": uri, "alt": f"time series of {label}" if uri else label, "caption": ""})
    return figures


def _repeats(report: Report, timelines: Mapping[tuple[int, int], str]) -> list[dict[str, Any]]:
    """Per point: each repeat's status, time, headline totals and timeline file if traced (folded on the page)."""
    return [{"index": p.index, "label": point_label(p, report.axes), "status": p.status,
             "rows": [{"repeat": r.repeat, "status": r.status, "elapsed": format_value(r.elapsed_s),
                       "batches": format_value(r.totals.batches_per_s),
                       "goodput": format_value(r.totals.goodput_bytes_per_s, "bytes_per_s"),
                       "acc": format_value(r.totals.test_accuracy, "pct"),
                       "to_target": ("not reached" if r.totals.target_reached is False
                                     else format_value(r.totals.time_to_target_s)), "error": r.error or "",
                       "timeline": timelines.get((p.index, r.repeat))}
                      for r in p.repeats]} for p in report.points]


def render_page(reports: Sequence[tuple[str, Report | Mapping[str, Any]]],
                timelines: Mapping[tuple[int, int], str] | None = None) -> str:
    """The page for one report, or several on the same axes, as HTML text.

    `reports`: (label, report) pairs; a report is a `Report` or its JSON object (any schema version).
    `timelines`: for one report, {(point index, repeat): file name} of the repeats' Chrome traces
    (`harness.present.timeline.write_timelines`) the repeats' table links.

    Raises:
        HarnessError: no report, a mapping that is not a report, or matplotlib missing.
    """
    if Figure is None:
        raise HarnessError("matplotlib is needed for --html: pip install -e .")
    if not reports:
        raise HarnessError("no report to render")
    typed = [(label, as_report(report)) for label, report in reports]
    layout = ChartLayout(typed)
    charts = []
    for key, title, ylabel, factor in CHART_METRICS:
        uri = metric_chart(key, title, ylabel, factor, layout, typed)
        if uri:
            charts.append({"uri": uri, "alt": f"{title} by {layout.x_name}", "caption": ""})
    for metric in held_out_metrics(typed):  # quality against wall time, every point of every report
        uri = held_out_chart(metric, typed)
        if uri:
            charts.append({"uri": uri, "alt": f"held-out {metric} against wall time",
                           "caption": "Evaluated during training on a copy of the parameters (eval_every_s); "
                                      "faint lines: the other repeats of a point."})
    limits = timeseries_limits(typed)
    compare = len(typed) > 1
    views = []
    for r_i, (label, report) in enumerate(typed):
        views.append({**_meta(label, report, "h2" if compare else "h1"), "anchor": f"failures-{r_i + 1}",
                      "table": _table(report), "failures": _failures(report), "reference": _reference(report),
                      "timeseries": _timeseries(report, limits), "repeats": _repeats(report, timelines or {})})
    title = ("Comparison: " + " vs ".join(label for label, _ in typed)) if compare else typed[0][0]
    return _environment().get_template(TEMPLATE).render(title=title, compare=compare, charts=charts,
                                                        reports=views, failed_color=FAILED_COLOR)


def report_label(path: Path) -> str:
    """A report's name on the page: its folder (<name>-<UTC stamp>)."""
    path = Path(path)
    return (path.parent if path.name == "report.json" else path).name


def default_html_path(paths: Sequence[Path]) -> Path:
    """Where `write_html` puts the page: ``report.html`` in the report's folder for one report,
    ``compare-<B>-vs-<C>.html`` in the first report's folder for several (names made file-safe)."""
    folders = [(p.parent if p.name == "report.json" else p) for p in map(Path, paths)]
    if len(folders) == 1:
        return folders[0] / "report.html"
    others = "-vs-".join(re.sub(r"[^A-Za-z0-9_.-]", "_", f.name) for f in folders[1:])
    return folders[0] / f"compare-{others}.html"


def write_html(paths: Iterable[str | Path], out: str | Path | None = None) -> Path:
    """Render the reports at `paths` (report.json files or their folders) into one page, written
    atomically to `out` (default: `default_html_path`); return its path.

    Raises:
        HarnessError: a report cannot be read, or matplotlib is missing.
        OSError: the page cannot be written.
    """
    paths = [Path(p) for p in paths]
    loaded = []
    seen: dict[str, int] = {}
    for path in paths:
        label = report_label(path)
        seen[label] = seen.get(label, 0) + 1
        if seen[label] > 1:
            label += f" #{seen[label]}"
        loaded.append((label, load_report(path)))
    target = Path(out) if out else default_html_path(paths)
    timelines = {}
    if len(loaded) == 1:  # the traced repeats' timelines beside the page, which links them
        from harness.present.timeline import write_timelines
        timelines = write_timelines(loaded[0][1].to_json_dict(), target.parent)
    write_text_atomic(target, render_page(loaded, timelines))
    return target
