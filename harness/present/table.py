"""Text tables of the present stage, drawn with `rich`: `render_table` (any rows; also used by
bench-wire) and `format_table` (a sweep report: medians over repeats, ± stdev, ``!`` for unstable).
"""

from __future__ import annotations

import io
from typing import Any, Collection, Iterable, Mapping, Sequence

from rich import box
from rich.console import Console
from rich.table import Table

from harness.analysis.window_model import repeat_row
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


# Shown when the report has an engine axis with ddp: each point's figures over ddp's in its group
BASELINE_ENGINE = "ddp"
VS_BASELINE_COLUMN = f"samples/s vs {BASELINE_ENGINE}"
TARGET_VS_BASELINE_COLUMN = f"to target vs {BASELINE_ENGINE}"
VS_BASELINE_LEGEND = (f"vs {BASELINE_ENGINE}: the point's median over the median of the {BASELINE_ENGINE} point with the "
                      f"same other params; samples/s (the global batch over the mean step time after warm-up) "
                      f"above 1.00x and time to target below 1.00x beat {BASELINE_ENGINE} (significance: wiiide-lab "
                      f"compare)")


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


def _median(point: Point, key: str) -> float | None:
    stats = point.summary.get(key)
    return stats.median if stats else None


def _ratio_text(value: float | None, reference: float | None) -> str:
    return "-" if value is None or not reference else f"{value / reference:.2f}x"


def baseline_cells(report: Report) -> dict[int, list[str]]:
    """Per point index, its cells under `VS_BASELINE_COLUMN` (and `TARGET_VS_BASELINE_COLUMN` when the
    report has targets): the median samples/s (``throughput_samples_per_s``) and median time to target
    (``time_to_target_s``, over the repeats that reached it) over those of the `BASELINE_ENGINE` point
    whose other params are equal, as ``1.23x``; ``baseline`` on that point; ``-`` where either side has
    no figure or the group has no baseline point. Empty when the report has no ``engine`` axis or no
    point of that engine (the table then has no such columns)."""
    if "engine" not in report.axes or not any(p.params.get("engine") == BASELINE_ENGINE for p in report.points):
        return {}

    def group(point: Point) -> str:
        return repr(sorted((k, repr(v)) for k, v in point.params.items() if k != "engine"))

    references = {group(p): p for p in report.points if p.params.get("engine") == BASELINE_ENGINE}
    keys = ["throughput_samples_per_s", *(["time_to_target_s"] if has_targets(report) else [])]
    cells: dict[int, list[str]] = {}
    for point in report.points:
        ref = references.get(group(point))
        if ref is point:
            cells[point.index] = ["baseline"] * len(keys)
        else:
            cells[point.index] = [_ratio_text(_median(point, k), ref and _median(ref, k)) for k in keys]
    return cells


def baseline_columns(report: Report) -> list[str]:
    """The headers of `baseline_cells`: none, `VS_BASELINE_COLUMN`, or it and `TARGET_VS_BASELINE_COLUMN`."""
    if not baseline_cells(report):
        return []
    return [VS_BASELINE_COLUMN, *([TARGET_VS_BASELINE_COLUMN] if has_targets(report) else [])]


def link_cells(point: Point) -> list[str]:
    """The point's cells under `LINK_COLUMNS`: the rates in force and what was not applied (from its
    first repeat that shaped anything), and the median coordinator egress utilisation in %."""
    links = next((r.links for r in point.repeats if r.links.get("containers")), None)
    utilisation = point.summary.get("coordinator_egress_utilisation")
    return [applied_rates_text(links) if links else "-", unsupported_text(links) if links else "-",
            f"{100 * utilisation.median:.0f}" if utilisation and utilisation.median is not None else "-"]


WINDOW_COLUMN = "window probe (model) Mbit/s"


def window_cell(point: Point) -> str:
    """The point's window probe beside the window model, ``measured (model)`` in Mbit/s (``measured
    (model, kernel K)`` with the model of the kernel's own window where recorded), from its first repeat
    with both probes (`harness.analysis.window_model`); ``-`` when none has them."""
    for repeat in point.repeats:
        row = repeat_row(point.params, {"links": repeat.links, "repeat": repeat.repeat})
        if row is not None:
            kernel = f", kernel {row.kernel_model_bps / 1e6:.0f}" if row.kernel_model_bps else ""
            return f"{row.measured_bps / 1e6:.0f} ({row.model_bps / 1e6:.0f}{kernel})"
    return "-"


def report_title(report: Report) -> str:
    """One line on where the numbers come from: name, backend, CPUs, commit, INCOMPLETE if not finished."""
    return (f"{report.name} | backend {report.backend.name} | {report.machine_info.cpu_count_logical} CPUs | "
            f"commit {(report.commit_info.id or '?')[:10]}{'' if report.complete else ' | INCOMPLETE'}")


def format_table(report: Report | Mapping[str, Any]) -> str:
    """The report's points as a text table: index, params, the links applied (when a point shapes
    links), status, ok repeats, the figures against ddp (`baseline_cells`, when the report has an engine
    axis with ddp), then each `TABLE_COLUMNS` figure as median ± stdev over the ok
    repeats with ``!`` for unstable; then a legend and each failed point's error.

    Raises:
        HarnessError: `report` is a mapping that is not a report.
    """
    report = as_report(report)
    params = report.axes
    has_links = any((p.cluster or {}).get("link") for p in report.points)  # shaped: show what was applied
    columns = table_columns(report)
    windows = [window_cell(p) for p in report.points] if has_links else []
    has_windows = any(cell != "-" for cell in windows)
    versus = baseline_cells(report)
    header = ["#", *params, *(LINK_COLUMNS if has_links else []), *([WINDOW_COLUMN] if has_windows else []),
              "status", "n", *baseline_columns(report), *[c[0] for c in columns]]
    rows = []
    for i, point in enumerate(report.points):
        rows.append([point.index, *[format_value(point.params.get(p)) for p in params],
                     *(link_cells(point) if has_links else []), *([windows[i]] if has_windows else []),
                     point.status, len(point.ok_repeats), *versus.get(point.index, []),
                     *[stats_cell(point, key, kind) for _, key, kind in columns]])
    machine = report.machine_info
    title = (f"{report.name} ({report.spec.description}) | backend {report.backend.name} | "
             f"{machine.cpu_count_logical} CPUs, {(machine.memory_total_bytes or 0) / 2**30:.0f} GiB | "
             f"commit {(report.commit_info.id or '?')[:10]}{'' if report.complete else ' | INCOMPLETE'}")
    notes = [f"point {p.index} {p.status}: {p.error}" for p in report.points if p.status != "ok" and p.error]
    legend = f"medians over repeats, ±stdev; {UNSTABLE_LEGEND}"
    targets = [TARGET_LEGEND] if has_targets(report) else []
    return render_table(title, header, rows, footer=[legend, *targets, *([VS_BASELINE_LEGEND] if versus else []),
                                                     *notes])
