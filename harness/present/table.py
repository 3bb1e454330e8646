"""The report as a text table: medians over repeats, stdev and an unstable mark per figure.
"""

from __future__ import annotations

from typing import Any

from harness.present.links_text import LINK_COLUMNS, link_cells


def _fmt(value: Any, kind: str = "") -> str:
    if value is None:
        return "-"
    if kind == "bytes_per_s":
        return f"{value / 1e6:.2f}"
    if kind == "pct":
        return f"{100 * value:.1f}"
    if kind == "ms":
        return f"{1000 * value:.2f}"
    if kind == "mb":
        return f"{value / 1e6:.0f}"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


# (column title, summary key, format)
TABLE_COLUMNS = [
    ("batches/s", "batches_per_s", ""),
    ("goodput MB/s", "goodput_bytes_per_s", "bytes_per_s"),
    ("step ms", "step_time_median_s", "ms"),
    ("net s/worker", "worker_network_time_s", ""),
    ("ratio", "compression_ratio", ""),
    ("acc %", "test_accuracy", "pct"),
    ("RSS MB", "peak_rss_bytes", "mb"),
]


def format_table(report: dict[str, Any]) -> str:
    """The points as a fixed-width table: params, status, repeats, then medians over repeats (± stdev)."""
    params = report.get("param_names") or sorted({k for p in report["points"] for k in p.get("params", {})})
    has_links = any((p.get("cluster") or {}).get("link") for p in report["points"])  # shaped: show what was applied
    header = ["#", *params, *(LINK_COLUMNS if has_links else []), "status", "n", *[c[0] for c in TABLE_COLUMNS]]
    rows = []
    for point in report["points"]:
        summary = point.get("summary", {})
        cells = [str(point["index"]), *[_fmt(point["params"].get(p)) for p in params],
                 *(link_cells(point) if has_links else []), point["status"],
                 str(sum(r["status"] == "ok" for r in point.get("repeats", [])))]
        for _, key, kind in TABLE_COLUMNS:
            stats = summary.get(key)
            text = _fmt(stats["median"], kind) if stats else "-"
            if stats and stats["count"] > 1 and stats["stdev"]:
                text += "±" + _fmt(stats["stdev"], kind)
            if key in point.get("unstable", []):
                text += "!"
            cells.append(text)
        rows.append(cells)
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(header, widths)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    backend = report.get("backend", {})
    machine = report.get("machine_info", {})
    title = (f"{report.get('name')} ({report.get('spec', {}).get('description', '')}) | backend {backend.get('name')} | "
             f"{machine.get('cpu_count_logical')} CPUs, {(machine.get('memory_total_bytes') or 0) / 2**30:.0f} GiB | "
             f"commit {(report.get('commit_info', {}).get('id') or '?')[:10]}"
             f"{'' if report.get('complete') else ' | INCOMPLETE'}")
    notes = []
    for point in report["points"]:
        if point["status"] != "ok" and point.get("error"):
            notes.append(f"point {point['index']} {point['status']}: {point['error']}")
    legend = "medians over repeats, ±stdev; '!' marks a spread over 10 % of the mean (unstable)"
    return "\n".join([title, *lines, legend, *notes])
