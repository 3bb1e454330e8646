"""The round model's rows as text or a Markdown table, and the ``round-model`` command.

``wiiide-lab round-model REPORT.json`` (or ``python -m harness.analysis.round_table``): one row per point
on a rate-limited link, the model's step, the measured one and the error (`harness.analysis.point_model`);
``--markdown``: one line per engine, each cell the error in %, bold within `TARGET_ERROR`, the count
within it; ``--per-repeat``: a row per repeat, from that repeat alone.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:  # the model (torch's codecs among its imports) loads when a report is modelled
    from harness.analysis.point_model import ModelRow

TARGET_ERROR = 0.10  # the model's aim: within 10 % of the measured step on the shaped links


def render(rows: Sequence[ModelRow]) -> str:
    """Rows as text: the point's parameters (as wide as the longest, so engine labels stay whole), model
    ms, measured ms, error %, then the model's two bounds (links, cores; ``-`` where not known), the
    compute phase of the two-phase model (``-``: the roofline), the slowest worker's path (``-``: not
    recorded), the simulated schedule (``-``: not recorded), the bytes-only model with
    its error, and for a traced run (``sweep --sched-trace``; ``-`` otherwise) the cores the scheduler
    lost and the model's error had it lost none."""
    labels = [", ".join(f"{k}={v}" for k, v in row.params.items()) for row in rows]
    width = max([60, *map(len, labels)])
    lines = [f"{'point':{width}} {'model ms':>9} {'measured ms':>12} {'error':>7} {'links ms':>9} {'cores ms':>9} "
             f"{'compute ms':>10} {'slowest ms':>10} {'simulated ms':>12} {'bytes-only ms':>14} {'error':>7} "
             f"{'lost cores':>10} {'error, none lost':>16}"]

    def ms(value: float | None) -> str:
        return f"{value * 1e3:9.1f}" if value is not None else f"{'-':>9}"

    for row, label in zip(rows, labels):
        simple = (f" {row.bytes_model_step_s * 1e3:14.1f} {(row.bytes_model_step_s / row.measured_step_s - 1) * 100:+6.1f}%"
                  if row.bytes_model_step_s else f" {'-':>14} {'-':>7}")
        if row.work_conserving_error is not None:
            simple += f" {row.lost_cores:10.2f} {row.work_conserving_error * 100:+15.1f}%"
        else:
            simple += f" {'-':>10} {'-':>16}"
        lines.append(f"{label:{width}} {row.model_step_s * 1e3:9.1f} {row.measured_step_s * 1e3:12.1f} "
                     f"{row.error * 100:+6.1f}% {ms(row.link_model_step_s)} {ms(row.cpu_step_s)} "
                     f"{ms(row.compute_phase_s)} {ms(row.slowest_path_s)}    {ms(row.simulated_step_s)} {simple}")
    return "\n".join(lines)


def _error_cell(error: float) -> str:
    """A relative error as a Markdown cell in % (``+5.0``), bold within `TARGET_ERROR`."""
    text = f"{error * 100:+.1f}"
    return f"**{text}**" if abs(error) <= TARGET_ERROR else text


def render_markdown(rows: Sequence[ModelRow], row_param: str = "engine") -> str:
    """Rows as a Markdown table, the form of studies/round-model/NOTE.md: one line per value of `row_param` (the engine), one
    column per setting of the other parameters (in the order the rows first show them), each cell the
    model's error in % against the measured step, bold within `TARGET_ERROR`; for a traced run (``sweep
    --sched-trace``) the error had the scheduler lost no core after a slash and the lost cores in
    brackets. Then per line and in all, the cells within the target. Rows with one setting twice: the
    first one counts."""
    lines_of: dict[str, dict[str, ModelRow]] = {}
    columns: list[str] = []
    for row in rows:
        line = str(row.params.get(row_param, "-"))
        column = " ".join(str(v) for k, v in row.params.items() if k != row_param)
        if column not in columns:
            columns.append(column)
        lines_of.setdefault(line, {}).setdefault(column, row)
    target = f"{TARGET_ERROR * 100:g} %"
    out = [f"| {row_param} | " + " | ".join(columns) + f" | within {target} |",
           "|---|" + "---|" * (len(columns) + 1)]
    within = total = 0
    for line, cells in lines_of.items():
        texts = []
        for column in columns:
            row = cells.get(column)
            if row is None:
                texts.append("")
                continue
            text = _error_cell(row.error)
            if row.work_conserving_error is not None:
                text += f" / {_error_cell(row.work_conserving_error)} ({row.lost_cores:.2f})"
            texts.append(text)
        hits = sum(abs(row.error) <= TARGET_ERROR for row in cells.values())
        within, total = within + hits, total + len(cells)
        out.append(f"| {line} | " + " | ".join(texts) + f" | {hits} of {len(cells)} |")
    out.append(f"\nWithin {target} of the measured step: {within} of {total} points.")
    return "\n".join(out)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``round-model`` verb's arguments: REPORT, ``--per-repeat``, ``--markdown``."""
    parser.add_argument("report", help="a sweep's report.json")
    parser.add_argument("--per-repeat", action="store_true",
                        help="one row per repeat: the model and the measured step from that repeat alone")
    parser.add_argument("--markdown", action="store_true",
                        help=f"the errors as a Markdown table (one line per engine, bold within "
                             f"{TARGET_ERROR * 100:g} %%)")


def main_from_args(args: argparse.Namespace) -> int:
    """Print the rows of `args.report`; exit status 0, or 2 with the error on stderr (unreadable, not
    JSON, or not a sweep report)."""
    try:
        report = json.loads(Path(args.report).read_text())
    except (OSError, ValueError) as exc:
        print(f"error: {args.report}: {exc}", file=sys.stderr)
        return 2
    if not isinstance(report, dict) or not isinstance(report.get("points"), list):
        print(f"error: {args.report}: not a sweep report (no 'points')", file=sys.stderr)
        return 2
    from rich.console import Console
    from rich.progress import track

    from harness.analysis.point_model import model_rows
    console = Console(stderr=True)
    rows = model_rows(report, args.per_repeat,  # the simulated schedules take up to seconds a point
                      (lambda points: track(points, description="modelling the points", console=console,
                                            transient=True)) if console.is_terminal else None)
    print((render_markdown(rows) if args.markdown else render(rows)) if rows
          else "no point on a rate-limited link that the model covers")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m harness.analysis.round_table REPORT``: `main_from_args` of the parsed `argv`."""
    parser = argparse.ArgumentParser(prog="wiiide-lab round-model", description=__doc__.split("\n")[0])
    add_arguments(parser)
    return main_from_args(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
