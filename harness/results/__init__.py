"""The results stage: a sweep's report (per point, per repeat, totals and stats), saved atomically and
loaded back, older schema versions included, and read as pandas tables.

    from harness.results import frames, load_report
    report = load_report("results/seed-buffers-20261121T150827Z")   # a typed Report
    df = frames.to_dataframe(report, "repeats")                       # or "nodes", "stats", "evals"

(`harness.results.frames` imports pandas; importing this package does not.)
"""

from harness.results.models import TABLES, Report, TableName
from harness.results.report import load_report

__all__ = ["TABLES", "Report", "TableName", "load_report"]
