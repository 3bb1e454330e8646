"""``wiiide-lab export REPORT --format csv|parquet``: a report's tables (`harness.results.frames`) as
files an analyst's tools read: ``<table>.csv`` (pandas ``to_csv``, no index) or ``<table>.parquet``
(pandas ``to_parquet`` with pyarrow, dtypes kept), written atomically next to the report or in ``--out``.

CSV carries no types: read a table back with its dtypes (``pd.read_csv(path, dtype=...)``) or use
Parquet, which keeps them (docs/results.md).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Iterable

from harness.errors import HarnessError
from harness.results.models import TABLES, Report, TableName
from harness.results.report import load_report
from wiiide.metrics import write_bytes_atomic

FORMATS = ("csv", "parquet")


def export_tables(report: Report, out_dir: Path, fmt: str = "csv",
                  tables: Iterable[TableName] = TABLES) -> list[Path]:
    """Write each of `tables` of `report` as ``out_dir/<table>.<fmt>`` (the folder made if needed),
    each file atomically (`wiiide.atomic_write.write_bytes_atomic`); return the paths in `tables`' order.

    Raises:
        HarnessError: `fmt` is not one of `FORMATS`, a table name is unknown, or a node's metrics in
            the report have a field of the wrong type.
        OSError: the folder cannot be written.
    """
    from harness.results import frames  # pandas, imported when a table is written, not when the CLI starts

    if fmt not in FORMATS:
        raise HarnessError(f"format {fmt!r}: the formats are {', '.join(FORMATS)}")
    paths = []
    for name in tables:
        frame = frames.to_dataframe(report, name)
        data = (frame.to_csv(index=False).encode("utf-8") if fmt == "csv"
                else frame.to_parquet(None, engine="pyarrow", index=False))
        path = Path(out_dir) / f"{name}.{fmt}"
        write_bytes_atomic(path, data)
        paths.append(path)
    return paths


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``export`` verb's arguments."""
    parser.add_argument("report", metavar="REPORT", help="a report.json or the folder holding it")
    parser.add_argument("--format", choices=FORMATS, default="csv", help="csv (default) or parquet (keeps dtypes)")
    parser.add_argument("--table", action="append", choices=TABLES, metavar="TABLE",
                        help=f"one of {', '.join(TABLES)} (repeatable; default: every table)")
    parser.add_argument("--out", metavar="DIR", help="where the files go (default: the report's folder)")


def main(args: argparse.Namespace) -> int:
    """Export the tables `args` names, print each file's path; exit code 0. Raises HarnessError for an
    unreadable report or a table that cannot be built."""
    path = Path(args.report)
    report = load_report(path)
    out = Path(args.out) if args.out else (path if path.is_dir() else path.parent)
    for written in export_tables(report, out, args.format, args.table or TABLES):
        print(written)
    return 0
