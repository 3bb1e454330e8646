"""Sweep reports as one self-contained HTML page: charts (matplotlib, Agg, PNG embedded as base64),
the table, failures with their errors, and each point's per-container time series.

``render_page([(label, report), ...])`` returns the page; with several reports the charts put them on
the same axes (one series each) for comparison. The page loads nothing: every image is a ``data:``
URI, the style is inline, there is no script, and a Content-Security-Policy forbids any other source,
so it reads the same offline, attached to a mail or opened from a CI artefact.

``write_html(paths)`` loads report.json files and writes the page: ``<report folder>/report.html`` for
one report, ``<first report folder>/compare-<other folders>.html`` for several (or ``out``).
"""

from __future__ import annotations

import base64
import html
import io
import math
import re
import statistics
from pathlib import Path
from string import Template
from typing import Any, Iterable, Sequence

from harness.errors import HarnessError
from harness.present.table import TABLE_COLUMNS, _fmt
from harness.results.report import load_report

try:  # the Agg canvas is used through Figure.savefig; pyplot (and its global state) is never imported
    from matplotlib.figure import Figure
except ImportError:  # pragma: no cover - requirements.txt installs it
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

PAGE = Template("""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; img-src data:; style-src 'unsafe-inline'">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>$title</title>
<style>
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; color: #222; margin: 0 auto;
       max-width: 1180px; padding: 16px 24px 48px; background: #fff; }
h1 { font-size: 22px; margin: 8px 0 4px; } h2 { font-size: 18px; margin: 28px 0 8px; border-bottom: 1px solid #ddd; }
h3 { font-size: 15px; margin: 18px 0 6px; }
.meta { color: #555; margin: 2px 0; } .note { color: #555; font-size: 13px; }
.banner { background: #fdecea; border: 1px solid $failed; color: #7b241c; padding: 8px 12px; margin: 10px 0; }
.charts { display: grid; grid-template-columns: repeat(auto-fill, minmax(540px, 1fr)); gap: 12px; }
figure { margin: 0; } figure img { max-width: 100%; height: auto; border: 1px solid #eee; }
figcaption { font-size: 12px; color: #555; }
table { border-collapse: collapse; margin: 6px 0 10px; font-size: 13px; }
th, td { border: 1px solid #ddd; padding: 3px 8px; text-align: right; vertical-align: top; }
th { background: #f4f6f8; } td.text, th.text { text-align: left; }
tr.failed td, tr.partial td { background: #fdf2f0; }
.status-failed, .status-partial { color: $failed; font-weight: 600; }
.error { color: #7b241c; font-family: ui-monospace, monospace; font-size: 12px; white-space: pre-wrap;
         text-align: left; }
details { margin: 6px 0; } summary { cursor: pointer; color: #333; }
code, pre { font-family: ui-monospace, "SFMono-Regular", Menlo, monospace; font-size: 12px; }
pre { background: #f7f7f7; padding: 8px; overflow-x: auto; }
</style>
</head>
<body>
$body
</body>
</html>
""")


def _esc(value: Any) -> str:
    return html.escape(str(value), quote=True)


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


def point_label(point: dict[str, Any], names: Sequence[str]) -> str:
    params = point.get("params") or {}
    if not names:
        return "(single point)"
    return ", ".join(f"{n}={param_text(params.get(n))}" for n in names)


def _report_params(report: dict[str, Any]) -> list[str]:
    return list(report.get("param_names") or sorted({k for p in report.get("points", []) for k in p.get("params", {})}))


def _ok_values(point: dict[str, Any], key: str) -> list[float]:
    return [r["totals"][key] for r in point.get("repeats", [])
            if r.get("status") == "ok" and _finite((r.get("totals") or {}).get(key))]


def _png(fig: Any) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, metadata={"Software": None})
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def _img(uri: str, alt: str, caption: str = "") -> str:
    cap = f"<figcaption>{_esc(caption)}</figcaption>" if caption else ""
    return f'<figure><img src="{uri}" alt="{_esc(alt)}">{cap}</figure>'


class _Layout:
    """Where each point goes on the charts' x axis, and which series it belongs to.

    When every report sweeps the same axes, x is the first axis and each combination of the other axes
    (per report) is a series; otherwise x is the whole "name=value, ..." label and each report a series.
    """

    def __init__(self, reports: Sequence[tuple[str, dict[str, Any]]]) -> None:
        names = [_report_params(r) for _, r in reports]
        self.shared = bool(names) and all(n == names[0] for n in names) and bool(names[0])
        self.x_name = names[0][0] if self.shared else "point"
        self.x_values: list[str] = []
        self.series: list[str] = []
        self.where: dict[tuple[int, int], tuple[str, str]] = {}  # (report #, point index) -> (x, series)
        for r_i, (label, report) in enumerate(reports):
            pnames = names[r_i]
            for point in report.get("points", []):
                params = point.get("params") or {}
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
                self.where[(r_i, point["index"])] = (x, series)


def reference_figures(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The seeds' figures of a report's `reference` block, each matched to a point where one fits.

    Returns rows {key, field, text, value, metric, point}: `value` in the report's raw unit (bytes/s,
    batches/s) when numeric and mapped to a figure this harness measures, else None; `point` is the
    point whose only swept value equals the reference's key (single-axis sweeps), else None.
    """
    ref = (report.get("spec") or {}).get("reference") or {}
    values = ref.get("values")
    if not isinstance(values, dict):
        return []
    metric_text = str(ref.get("metric", "")).lower()
    default = next(((key, factor) for word, key, factor in REFERENCE_METRICS if word in metric_text), (None, 1.0))
    names = _report_params(report)
    by_value = {}
    if len(names) == 1:
        by_value = {param_text((p.get("params") or {}).get(names[0])): p for p in report.get("points", [])}
    rows = []
    for key, entry in values.items():
        fields = entry.items() if isinstance(entry, dict) else [(None, entry)]
        for field, raw in fields:
            metric, factor = REFERENCE_FIELDS.get(field, (None, 1.0)) if field else default
            value = raw * factor if (metric and _finite(raw)) else None
            rows.append({"key": str(key), "field": field, "text": str(raw), "value": value, "metric": metric,
                         "point": by_value.get(str(key))})
    return rows


# ----------------------------------------------------------------------------------------------- charts

def _metric_chart(key: str, title: str, ylabel: str, factor: float, layout: _Layout,
                  reports: Sequence[tuple[str, dict[str, Any]]]) -> str | None:
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
        for point in report.get("points", []):
            x, series = layout.where[(r_i, point["index"])]
            pos = xs[x] + offsets[series]
            values = [v * factor for v in _ok_values(point, key)]
            if values:
                data[series].append((pos, values))
            elif point.get("status") in ("failed", "partial", "running"):
                failed.append((pos, point.get("status")))
        mine = []
        for row in reference_figures(report):
            if row["metric"] == key and row["value"] is not None and row["point"] is not None:
                x, series = layout.where[(r_i, row["point"]["index"])]
                mine.append((xs[x] + offsets[series], row["value"] * factor))
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


def _representative_repeat(point: dict[str, Any]) -> dict[str, Any] | None:
    """The ok repeat with the median batches/s (the one to look at), else the last repeat with samples."""
    ok = [r for r in point.get("repeats", []) if r.get("status") == "ok"]
    if ok:
        ok.sort(key=lambda r: (r.get("totals") or {}).get("batches_per_s") or 0)
        return ok[(len(ok) - 1) // 2]
    with_samples = [r for r in point.get("repeats", [])
                    if any(c.get("samples") for c in (r.get("containers") or {}).values())]
    return with_samples[-1] if with_samples else None


def _series_of(samples: list[dict[str, Any]]) -> dict[str, tuple[list[float], list[float]]]:
    """t and CPU %, memory MB and network rx+tx MB/s (from the counters' differences) of one container."""
    samples = sorted((s for s in samples if _finite(s.get("t_s"))), key=lambda s: s["t_s"])
    out: dict[str, tuple[list[float], list[float]]] = {}
    cpu = [(s["t_s"], s["cpu_percent"]) for s in samples if _finite(s.get("cpu_percent"))]
    mem = [(s["t_s"], s["memory_bytes"] / 1e6) for s in samples if _finite(s.get("memory_bytes"))]
    net = [(s["t_s"], s["net_rx_bytes"] + s["net_tx_bytes"]) for s in samples
           if _finite(s.get("net_rx_bytes")) and _finite(s.get("net_tx_bytes"))]
    rate = [((t0 + t1) / 2, (b1 - b0) / (t1 - t0) / 1e6) for (t0, b0), (t1, b1) in zip(net, net[1:]) if t1 > t0]
    for name, pairs in (("cpu", cpu), ("mem", mem), ("net", rate)):
        if pairs:
            out[name] = ([p[0] for p in pairs], [p[1] for p in pairs])
    return out


TIME_PANELS = [("cpu", "CPU (% of one core)"), ("mem", "memory without page cache (MB)"),
               ("net", "network rx+tx (MB/s)")]


def _timeseries_limits(reports: Sequence[tuple[str, dict[str, Any]]]) -> dict[str, tuple[float, float]]:
    """Shared y (per panel) and x limits over every point drawn, so the points compare at a glance."""
    top = {name: 0.0 for name, _ in TIME_PANELS}
    t_max = 0.0
    for _, report in reports:
        for point in report.get("points", []):
            rep = _representative_repeat(point)
            for c in ((rep or {}).get("containers") or {}).values():
                for name, (t, y) in _series_of(c.get("samples") or []).items():
                    top[name] = max(top[name], max(y))
                    t_max = max(t_max, max(t))
    limits = {name: (0.0, value * 1.08 or 1.0) for name, value in top.items()}
    limits["t"] = (0.0, t_max * 1.02 or 1.0)
    return limits


def _timeseries_chart(point: dict[str, Any], rep: dict[str, Any], limits: dict[str, tuple[float, float]],
                      title: str) -> str | None:
    containers = rep.get("containers") or {}
    series = {name: _series_of(c.get("samples") or []) for name, c in sorted(containers.items())}
    if not any(series.values()):
        return None
    fig = Figure(figsize=(11.2, 2.7))
    axes = fig.subplots(1, 3)
    workers = 0
    styles = {}
    for name, c in sorted(containers.items()):
        if (c.get("role") or "") == "coordinator" or "coordinator" in name:
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


# ----------------------------------------------------------------------------------------------- HTML

def _meta_html(label: str, report: dict[str, Any], heading: str) -> str:
    spec = report.get("spec") or {}
    backend = report.get("backend") or {}
    machine = report.get("machine_info") or {}
    commit = report.get("commit_info") or {}
    backend_text = backend.get("name", "?")
    if backend.get("engine_version"):
        compose = backend.get("compose_version") or backend.get("compose") or ""
        backend_text += f" (engine {backend['engine_version']}, {compose})"
    parts = [f"<{heading}>{_esc(label)}</{heading}>"]
    if spec.get("description"):
        parts.append(f'<p class="meta">{_esc(spec["description"])}</p>')
    parts.append(
        f'<p class="meta">backend {_esc(backend_text)} &middot; {_esc(machine.get("cpu_count_logical", "?"))} CPUs '
        f'({_esc(machine.get("cpu_model", "?"))}), {(machine.get("memory_total_bytes") or 0) / 2**30:.0f} GiB, '
        f'kernel {_esc(machine.get("kernel", "?"))}, rmem_max {_esc(machine.get("rmem_max_bytes", "?"))} B &middot; '
        f'commit {_esc((commit.get("id") or "?")[:10])}{" (dirty)" if commit.get("dirty") else ""} &middot; '
        f'{_esc(report.get("created_at_utc", "?"))} to {_esc(report.get("updated_at_utc", "?"))} &middot; '
        f'{_esc(spec.get("repeats", "?"))} repeat(s) per point</p>')
    if not report.get("complete"):
        note = report.get("note") or "the sweep has not finished (or was stopped)"
        parts.append(f'<p class="banner">INCOMPLETE: {_esc(note)}; '
                     f'{len(report.get("points", []))} of the spec\'s points have started.</p>')
    axes = spec.get("axes") or {}
    if axes:
        parts.append('<p class="meta">axes: ' + "; ".join(
            f"<b>{_esc(k)}</b> = {_esc(', '.join(param_text(v) for v in vs))}" for k, vs in axes.items()) + "</p>")
    if spec.get("base"):
        parts.append('<p class="meta">base: ' + _esc(", ".join(f"{k}={param_text(v)}" for k, v in spec["base"].items()))
                     + "</p>")
    return "\n".join(parts)


def _mib(n: Any) -> str:
    return f"{n / 2**20:g}" if _finite(n) else "?"


def socket_buffers(point: dict[str, Any]) -> str | None:
    """SO_SNDBUF/SO_RCVBUF as requested and as the kernel set them, from the coordinator's sockets."""
    seen = []
    for rep in point.get("repeats", []):
        for opt in ((rep.get("nodes") or {}).get("coordinator") or {}).get("socket_options") or []:
            snd = f"{_mib(opt.get('sndbuf_requested_bytes'))} → {_mib(opt.get('sndbuf_bytes'))}"
            rcv = f"{_mib(opt.get('rcvbuf_requested_bytes'))} → {_mib(opt.get('rcvbuf_bytes'))}"
            text = f"{snd} MiB" if snd == rcv else f"snd {snd}, rcv {rcv} MiB"
            if text not in seen:
                seen.append(text)
    return "; ".join(seen) or None


def _short_error(point: dict[str, Any], anchor: str, limit: int = 160) -> str:
    """The first line of each failed repeat's error, cut at `limit`; the whole text is under Failures."""
    bad = [r for r in point.get("repeats", []) if r.get("status") != "ok"]
    if not bad and not point.get("error"):
        return ""
    lines = [f"repeat {r.get('repeat')}: " + (str(r.get("error") or r.get("status")).strip().splitlines() or [""])[0]
             for r in bad] or [str(point.get("error")).splitlines()[0]]
    text = "; ".join(dict.fromkeys(lines))
    short = text if len(text) <= limit else text[:limit - 1] + "…"
    return f'{_esc(short)} <a href="#{anchor}">(in full below)</a>'


def _table_html(report: dict[str, Any], anchor: str) -> str:
    params = _report_params(report)
    buffers = {p["index"]: socket_buffers(p) for p in report.get("points", [])}
    show_buffers = any(buffers.values())
    head = ["#", *params, "status", "n ok", *[c[0] for c in TABLE_COLUMNS],
            *(["socket buffers, requested → effective"] if show_buffers else []), "error"]
    rows = []
    for point in report.get("points", []):
        status = point.get("status", "?")
        summary = point.get("summary") or {}
        cells = [f"<td>{_esc(point['index'])}</td>"]
        cells += [f'<td class="text">{_esc(param_text((point.get("params") or {}).get(p)))}</td>' for p in params]
        cells.append(f'<td class="text status-{_esc(status)}">{_esc(status)}</td>')
        repeats = point.get("repeats", [])
        cells.append(f"<td>{sum(r.get('status') == 'ok' for r in repeats)}/{len(repeats)}</td>")
        for _, key, kind in TABLE_COLUMNS:
            stats = summary.get(key)
            text = _fmt(stats["median"], kind) if stats else "-"
            if stats and stats.get("count", 0) > 1 and stats.get("stdev"):
                text += " ± " + _fmt(stats["stdev"], kind)
            if key in (point.get("unstable") or []):
                text += " !"
            cells.append(f"<td>{_esc(text)}</td>")
        if show_buffers:
            cells.append(f"<td>{_esc(buffers[point['index']] or '-')}</td>")
        cells.append(f'<td class="error">{_short_error(point, anchor)}</td>')
        rows.append(f'<tr class="{_esc(status)}">' + "".join(cells) + "</tr>")
    text_columns = {*params, "status", "error"}
    header = "".join(f'<th class="{"text" if h in text_columns else ""}">{_esc(h)}</th>' for h in head)
    return (f"<table><thead><tr>{header}</tr></thead><tbody>{''.join(rows)}</tbody></table>"
            '<p class="note">Medians over the ok repeats, ± stdev; "!" marks a spread over 10 % of the mean '
            "(unstable). goodput: tensor bytes through the parameter server per second, both directions.</p>")


def _failures_html(report: dict[str, Any], anchor: str) -> str:
    items = []
    for point in report.get("points", []):
        bad = [r for r in point.get("repeats", []) if r.get("status") != "ok"]
        if not bad and point.get("status") in ("ok", "running"):
            continue
        names = _report_params(report)
        lines = "".join(f"<li>repeat {_esc(r.get('repeat'))} {_esc(r.get('status'))}: "
                        f"<span class=\"error\">{_esc(r.get('error') or '(no error recorded)')}</span></li>" for r in bad)
        # the point's error joins its repeats' ones: show it only when no repeat says more
        error = "" if bad else f': <span class="error">{_esc(point.get("error") or "")}</span>'
        items.append(f'<li><b>point {_esc(point["index"])}</b> ({_esc(point_label(point, names))}) '
                     f'<span class="status-{_esc(point.get("status"))}">{_esc(point.get("status"))}</span>'
                     f'{error}<ul>{lines}</ul></li>')
    if not items:
        return ""
    return f'<h3 id="{anchor}">Failures</h3><ul>' + "".join(items) + "</ul>"


def _reference_html(report: dict[str, Any]) -> str:
    ref = (report.get("spec") or {}).get("reference") or {}
    rows = reference_figures(report)
    if not rows:
        return ""
    first_measured: dict[str | None, float] = {}
    first_seed: dict[str | None, float] = {}
    body = []
    for row in rows:
        metric = row["metric"]
        title = next((t for k, t, _, _ in CHART_METRICS if k == metric), None)
        unit = next((u for k, _, u, _ in CHART_METRICS if k == metric), "")
        factor = next((f for k, _, _, f in CHART_METRICS if k == metric), 1.0)
        measured = None
        if row["point"] is not None and metric:
            stats = (row["point"].get("summary") or {}).get(metric)
            measured = stats["median"] if stats else None
        measured_text = (f"{measured * factor:.3g}" if measured is not None
                         else "no matching point" if row["point"] is None else "-")
        rel_seed = rel_meas = "-"
        if row["value"] is not None and measured is not None:
            first_seed.setdefault(metric, row["value"])
            first_measured.setdefault(metric, measured)
            rel_seed = f"{row['value'] / first_seed[metric]:.2f}x"
            rel_meas = f"{measured / first_measured[metric]:.2f}x"
        body.append(
            "<tr>" + f'<td class="text">{_esc(row["key"])}</td>'
            + f'<td class="text">{_esc(row["field"] or ref.get("metric", ""))}</td>'
            + f'<td class="text">{_esc(row["text"])}</td>'
            + f'<td class="text">{_esc(f"{title} ({unit})" if title else "not measured here")}</td>'
            + f"<td>{_esc(measured_text)}</td>"
            + f"<td>{_esc(rel_seed)}</td><td>{_esc(rel_meas)}</td></tr>")
    return ("<h3>The seeds' figures next to this sweep</h3>"
            f'<p class="note">source: {_esc(ref.get("source", "?"))}; metric: {_esc(ref.get("metric", "?"))}. '
            "The relative columns divide each figure by the first matched one, to compare trends "
            "whatever the absolute scale.</p>"
            "<table><thead><tr><th class=\"text\">reference</th><th class=\"text\">figure</th>"
            "<th class=\"text\">seeds</th><th class=\"text\">compared with</th><th>measured (median)</th>"
            "<th>seeds, relative</th><th>measured, relative</th></tr></thead><tbody>"
            + "".join(body) + "</tbody></table>")


def _repeats_html(report: dict[str, Any]) -> str:
    """Per point: each repeat's status, time and headline totals, folded."""
    blocks = []
    names = _report_params(report)
    for point in report.get("points", []):
        rows = []
        for r in point.get("repeats", []):
            t = r.get("totals") or {}
            rows.append("<tr>" + f"<td>{_esc(r.get('repeat'))}</td>"
                        + f'<td class="text status-{_esc(r.get("status"))}">{_esc(r.get("status"))}</td>'
                        + f"<td>{_esc(_fmt(r.get('elapsed_s')))}</td><td>{_esc(_fmt(t.get('batches_per_s')))}</td>"
                        + f"<td>{_esc(_fmt(t.get('goodput_bytes_per_s'), 'bytes_per_s'))}</td>"
                        + f"<td>{_esc(_fmt(t.get('test_accuracy'), 'pct'))}</td>"
                        + f'<td class="error">{_esc(r.get("error") or "")}</td></tr>')
        blocks.append(f"<details><summary>point {_esc(point['index'])}: {_esc(point_label(point, names))} "
                      f"({_esc(point.get('status'))}, {len(point.get('repeats', []))} repeat(s))</summary>"
                      "<table><thead><tr><th>repeat</th><th class=\"text\">status</th><th>elapsed s</th>"
                      "<th>batches/s</th><th>goodput MB/s</th><th>acc %</th><th class=\"text\">error</th></tr></thead>"
                      f"<tbody>{''.join(rows)}</tbody></table></details>")
    return "<h3>Repeats</h3>" + "".join(blocks)


def _timeseries_html(report: dict[str, Any], limits: dict[str, tuple[float, float]]) -> str:
    names = _report_params(report)
    figures = []
    for point in report.get("points", []):
        label = f"point {point['index']}: {point_label(point, names)} ({point.get('status')})"
        rep = _representative_repeat(point)
        uri = (_timeseries_chart(point, rep, limits, f"{label}, repeat {rep.get('repeat')} ({rep.get('status')})")
               if rep else None)
        if uri:
            figures.append(_img(uri, f"time series of {label}"))
        else:
            figures.append(f'<p class="note">{_esc(label)}: no samples</p>')
    return ("<h3>Per container over time</h3>"
            '<p class="note">One repeat per point (the ok one with the median batches/s), every container; '
            "the axes are shared by all the points of this page.</p>" + "".join(figures))


def render_page(reports: Sequence[tuple[str, dict[str, Any]]]) -> str:
    """The page for one report, or several on the same axes. `reports`: (label, report dict) pairs."""
    if Figure is None:
        raise HarnessError("matplotlib is needed for --html: pip install -r requirements.txt")
    if not reports:
        raise HarnessError("no report to render")
    layout = _Layout(reports)
    charts = []
    for key, title, ylabel, factor in CHART_METRICS:
        uri = _metric_chart(key, title, ylabel, factor, layout, reports)
        if uri:
            charts.append(_img(uri, f"{title} by {layout.x_name}"))
    limits = _timeseries_limits(reports)
    compare = len(reports) > 1
    if compare:
        title = "Comparison: " + " vs ".join(label for label, _ in reports)
        body = [f"<h1>{_esc(title)}</h1>",
                '<p class="meta">Each report is one series on the same axes; its details follow below.</p>']
    else:
        title = reports[0][0]
        body = [_meta_html(reports[0][0], reports[0][1], "h1")]
    body += ["<h2>Figures by point</h2>",
             '<p class="note">Marker and line: median over the ok repeats; bar: min to max; dots: each repeat; '
             'a red &times; on the axis: a point with no ok repeat. Hollow diamonds: the seeds\' figures, '
             "where the spec's reference maps to the chart.</p>",
             ('<div class="charts">' + "".join(charts) + "</div>") if charts
             else '<p class="note">No ok repeat to chart.</p>']
    for r_i, (label, report) in enumerate(reports):
        anchor = f"failures-{r_i + 1}"
        if compare:
            body.append(_meta_html(label, report, "h2"))
        else:
            body.append("<h2>Table</h2>")
        body += [_table_html(report, anchor), _failures_html(report, anchor), _reference_html(report),
                 _timeseries_html(report, limits), _repeats_html(report)]
    return PAGE.substitute(title=_esc(title), body="\n".join(b for b in body if b), failed=FAILED_COLOR)


def report_label(path: Path) -> str:
    """A report's name on the page: its folder (<name>-<UTC stamp>)."""
    path = Path(path)
    return (path.parent if path.name == "report.json" else path).name


def default_html_path(paths: Sequence[Path]) -> Path:
    folders = [(p.parent if p.name == "report.json" else p) for p in map(Path, paths)]
    if len(folders) == 1:
        return folders[0] / "report.html"
    others = "-vs-".join(re.sub(r"[^A-Za-z0-9_.-]", "_", f.name) for f in folders[1:])
    return folders[0] / f"compare-{others}.html"


def write_html(paths: Iterable[str | Path], out: str | Path | None = None) -> Path:
    """Render the reports at `paths` (report.json files or their folders) into one page; return its path.

    Raises:
        HarnessError: a report cannot be read, or matplotlib is missing.
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
    page = render_page(loaded)
    target = Path(out) if out else default_html_path(paths)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp")
    tmp.write_text(page, encoding="utf-8")
    tmp.replace(target)
    return target
