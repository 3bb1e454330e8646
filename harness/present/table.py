"""Text tables of the present stage, drawn with `rich`: `render_table` (any rows; also used by
bench-wire) and `format_table` (a sweep report: medians over repeats, ± stdev, ``!`` for unstable).
"""

from __future__ import annotations

import io
from typing import Any, Collection, Iterable, Mapping, Sequence

from rich import box
from rich.console import Console
from rich.table import Table

from harness.present.links_text import (
    LINK_COLUMNS,
    applied_rates_text,
    unsupported_text,
)
from harness.results.models import Point, Report
from harness.results.report import as_report

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
    ``ms`` (seconds printed in ms), ``mb`` (bytes printed in MB), ``mb3`` (in MB, 3 significant digits), or ``""`` (3 significant digits,
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
    if kind == "mb3":  # three significant digits: a small model's tensors take well under 1 MB
        return f"{value / 1e6:.3g}"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


# (column title, summary key, format): the figures of the report's tables (text and HTML), in order
TABLE_COLUMNS = [
    ("batches/s", "batches_per_s", ""),
    ("goodput MB/s", "goodput_bytes_per_s", "bytes_per_s"),
    ("step ms", "step_time_median_s", "ms"),
    ("net s/worker", "worker_network_time_s", ""),
    ("ratio", "compression_ratio", ""),
    ("acc %", "test_accuracy", "pct"),
    ("RSS MB", "peak_rss_bytes", "mb"),
    ("tensor MB", "tensor_bytes_max", "mb3"),
]

UNSTABLE_LEGEND = "'!' marks a spread over 10 % of the mean (unstable)"
# Shown when a point asked for a target (target_accuracy / target_loss): time to target, its own cell
TARGET_COLUMN = ("to target s", "time_to_target_s", "target")
NOT_REACHED = "not reached"
TARGET_LEGEND = ("to target s: wall time from the start of training to the first held-out evaluation that "
                 "reached the target, median over the repeats that reached it, (k/n) when only k of n did")


def has_targets(report: Report) -> bool:
    """Whether any repeat of `report` evaluated against a target (its totals' ``target_reached`` is set)."""
    return any(r.totals.target_reached is not None for p in report.points for r in p.repeats)


def table_columns(report: Report) -> list[tuple[str, str, str]]:
    """`TABLE_COLUMNS`, and `TARGET_COLUMN` when the report has targets (`has_targets`)."""
    return [*TABLE_COLUMNS, *([TARGET_COLUMN] if has_targets(report) else [])]


def target_cell(point: Point, sep: str = "") -> str:
    """Time to target of a point: the median over the ok repeats that reached it (± stdev, ``!`` as
    `stats_cell`), followed by ``(k/n)`` when only k of the n ok repeats with a target reached it;
    ``not reached`` when none did; ``-`` when no ok repeat had a target."""
    judged = [r for r in point.ok_repeats if r.totals.target_reached is not None]
    reached = [r for r in judged if r.totals.target_reached]
    if not judged:
        return "-"
    if not reached:
        return NOT_REACHED
    text = stats_cell(point, "time_to_target_s", "", sep)
    return text if len(reached) == len(judged) else f"{text} ({len(reached)}/{len(judged)})"


def stats_cell(point: Point, key: str, kind: str = "", sep: str = "") -> str:
    """A figure's cell: its median over the point's ok repeats, ``±stdev`` when several repeats
    spread, ``!`` when unstable (`Stats.unstable`); ``-`` when no ok repeat has it. `kind`: as in
    `format_value`, or ``target`` for `target_cell`; `sep`: put around ``±`` and before ``!`` (the HTML
    page uses a space)."""
    if kind == "target":
        return target_cell(point, sep)
    stats = point.summary.get(key)
    text = format_value(stats.median, kind) if stats else "-"
    if stats and stats.count > 1 and stats.stdev:
        text += f"{sep}±{sep}" + format_value(stats.stdev, kind)
    if key in point.unstable:
        text += f"{sep}!"
    return text


def link_cells(point: Point) -> list[str]:
    """The point's cells under `LINK_COLUMNS`: the rates in force and what was not applied (from its
    first repeat that shaped anything), and the median coordinator egress utilisation in %."""
    links = next((r.links for r in point.repeats if r.links.get("containers")), None)
    utilisation = point.summary.get("coordinator_egress_utilisation")
    return [applied_rates_text(links) if links else "-", unsupported_text(links) if links else "-",
            f"{100 * utilisation.median:.0f}" if utilisation and utilisation.median is not None else "-"]


def report_title(report: Report) -> str:
    """One line on where the numbers come from: name, backend, CPUs, commit, INCOMPLETE if not finished."""
    return (f"{report.name} | backend {report.backend.name} | {report.machine_info.cpu_count_logical} CPUs | "
            f"commit {(report.commit_info.id or '?')[:10]}{'' if report.complete else ' | INCOMPLETE'}")


def format_table(report: Report | Mapping[str, Any]) -> str:
    """The report's points as a text table: index, params, the links applied (when a point shapes
    links), status, ok repeats, then each `TABLE_COLUMNS` figure as median ± stdev over the ok
    repeats with ``!`` for unstable; then a legend and each failed point's error.

    Raises:
        HarnessError: `report` is a mapping that is not a report.
    """
    report = as_report(report)
    params = report.axes
    has_links = any((p.cluster or {}).get("link") for p in report.points)  # shaped: show what was applied
    columns = table_columns(report)
    header = ["#", *params, *(LINK_COLUMNS if has_links else []), "status", "n", *[c[0] for c in columns]]
    rows = []
    for point in report.points:
        rows.append([point.index, *[format_value(point.params.get(p)) for p in params],
                     *(link_cells(point) if has_links else []), point.status, len(point.ok_repeats),
                     *[stats_cell(point, key, kind) for _, key, kind in columns]])
    machine = report.machine_info
    title = (f"{report.name} ({report.spec.description}) | backend {report.backend.name} | "
             f"{machine.cpu_count_logical} CPUs, {(machine.memory_total_bytes or 0) / 2**30:.0f} GiB | "
             f"commit {(report.commit_info.id or '?')[:10]}{'' if report.complete else ' | INCOMPLETE'}")
    notes = [f"point {p.index} {p.status}: {p.error}" for p in report.points if p.status != "ok" and p.error]
    legend = f"medians over repeats, ±stdev; {UNSTABLE_LEGEND}"
    targets = [TARGET_LEGEND] if has_targets(report) else []
    return render_table(title, header, rows, footer=[legend, *targets, *notes])
