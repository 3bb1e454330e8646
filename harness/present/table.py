"""Text tables of the present stage, drawn with `rich`: `render_table` (any rows; also used by
bench-wire) and `format_table` (a sweep report: medians over repeats, ± stdev, ``!`` for unstable).
"""

from __future__ import annotations

import io
from typing import Any, Collection, Iterable, Sequence

from rich import box
from rich.console import Console
from rich.table import Table

from harness.present.links_text import LINK_COLUMNS, link_cells

# Wide enough that no table is ever wrapped: a report table is read in a terminal or a log file,
# where a wrapped row is worse than a long one.
_CONSOLE_WIDTH = 100_000


def render_table(title: str | None, columns: Sequence[str], rows: Iterable[Sequence[Any]],
                 left_columns: Collection[str] = (), footer: Sequence[str] = ()) -> str:
    """Rows as plain text: an optional title line, a header, a rule, one line per row, footer lines.

    `columns`: the header cells; `rows`: one sequence of cells per row, as many as `columns`
    (a cell is printed with ``str``; ``None`` prints as ``-``). Cells are right-aligned (numbers)
    except in the columns named in `left_columns`. No colour, no box, no trailing spaces, never
    wrapped, so the text is the same on a terminal, in a pipe and in a test. Returns the text
    without a final newline.

    Raises:
        ValueError: a row has more or fewer cells than there are columns.
    """
    table = Table(box=box.SIMPLE, show_edge=False, pad_edge=False, padding=(0, 1))
    for name in columns:
        table.add_column(name, justify="left" if name in left_columns else "right", no_wrap=True)
    for i, row in enumerate(rows):
        cells = ["-" if c is None else str(c) for c in row]
        if len(cells) != len(columns):
            raise ValueError(f"row {i} has {len(cells)} cells, the table has {len(columns)} columns: {cells}")
        table.add_row(*cells)
    out = io.StringIO()
    Console(file=out, width=_CONSOLE_WIDTH, color_system=None, force_terminal=False, highlight=False,
            emoji=False, markup=False).print(table)
    lines = [line.rstrip() for line in out.getvalue().splitlines()]
    return "\n".join([*([title] if title else []), *lines, *footer])


def format_value(value: Any, kind: str = "") -> str:
    """A figure as the report's tables print it.

    `kind`: ``bytes_per_s`` (printed in MB/s, 1 MB = 1e6 bytes), ``pct`` (a fraction printed in %),
    ``ms`` (seconds printed in ms), ``mb`` (bytes printed in MB), or ``""`` (3 significant digits,
    no decimals from 1000 up; non-floats as ``str``). ``None`` prints as ``-``.
    """
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


_fmt = format_value  # the old private name, until html.py reads the typed report


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
    """The points as a table: params, status, repeats, then medians over repeats (± stdev)."""
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
    return render_table(title, header, rows, footer=[legend, *notes])
