"""The ``predict`` command: a measured report's engines at more workers, or the model against it.

``wiiide-lab predict REPORT --workers 16,64,256,1024 [--link PROFILE] [--machine-per-node]`` calibrates every
engine and link of REPORT on all its worker counts (`harness.analysis.predict`) and prints the predicted step
and samples/s at each of `--workers`; ``--validate 2,4`` instead calibrates on those worker counts only and
sets the prediction beside the measured steps of the report's other worker counts, with the geometric mean
and the worst of the errors. Both write the rows as JSON (``--out``, default ``predict.json`` beside the
report).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Sequence

from harness.analysis.predict import (
    Prediction,
    error_summary,
    predict_report,
    report_measurements,
    validate,
)
from harness.errors import HarnessError
from harness.results.report import load_report_json
from harness.spec.cluster import load_presets, parse_link


def _counts(text: str, option: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise HarnessError(f"{option}: expected worker counts >= 1 separated by commas, e.g. 16,64; got {text!r}")
    return counts


def render(rows: Sequence[Prediction]) -> str:
    """Rows as text: engine, link, workers, step ms, samples/s, the terms (ms), the bound, and where
    measured the measured step and the error."""
    width = max([10, *(len(r.engine) for r in rows)])
    lines = [f"{'engine':{width}} {'link':>12} {'workers':>7} {'step ms':>9} {'samples/s':>10} {'links ms':>9} "
             f"{'latency ms':>10} {'cores ms':>9} {'bound':>6} {'measured ms':>11} {'error':>7}"]
    for r in rows:
        measured = (f" {r.measured_step_s * 1e3:11.1f} {r.error * 100:+6.1f}%" if r.measured_step_s is not None
                    else f" {'-':>11} {'-':>7}")
        lines.append(f"{r.engine:{width}} {r.link:>12} {r.workers:7d} {r.step_s * 1e3:9.1f} {r.samples_per_s:10.0f} "
                     f"{r.links_s * 1e3:9.1f} {r.latency_s * 1e3:10.2f} {r.cores_s * 1e3:9.1f} {r.bound:>6}" + measured)
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``predict`` verb's arguments."""
    parser.add_argument("report", help="a sweep's report.json (or its folder)")
    parser.add_argument("--workers", default="16,64,256,1024", help="worker counts to predict (default %(default)s)")
    parser.add_argument("--link", help="predict on this link profile (a preset of experiments/links.yaml, e.g. "
                                       "rate-100m, wan-100m-20ms) instead of each point's own")
    parser.add_argument("--machine-per-node", action="store_true",
                        help="every node on its own machine (no shared cores); default: the report's machine's "
                             "cores shared by every node, as measured")
    parser.add_argument("--validate", metavar="COUNTS",
                        help="calibrate on these worker counts only (e.g. 2,4) and compare with the report's others")
    parser.add_argument("--out", help="the JSON file to write (default: predict.json beside the report)")


def main_from_args(args: argparse.Namespace) -> int:
    """Print the rows and write the JSON; exit 0, or 2 with the error on stderr."""
    try:
        counts = _counts(args.validate, "--validate") if args.validate else _counts(args.workers, "--workers")
        report = load_report_json(args.report)
        measured = report_measurements(report)
        if not measured:
            raise HarnessError(f"{args.report}: no ok point with a measured step to calibrate on")
        if args.validate:
            rows = validate(measured, counts)
            summary = error_summary(rows)
        else:
            rate_bps = delay_s = None
            if args.link:
                setting = parse_link(args.link, load_presets(), "--link")
                profile = setting.profiles.for_container("worker", 1) if setting else None
                rate_bps = profile.rate_bps if profile else None
                delay_s = (profile.delay_ms or 0.0) / 1e3 if profile else 0.0
            rows = predict_report(measured, counts, rate_bps=rate_bps, delay_s=delay_s,
                                  link=args.link, machine_per_node=args.machine_per_node)
            summary = None
    except HarnessError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(render(rows) if rows else "no engine with a worker count to calibrate on and another to check")
    if summary is not None and summary["count"]:
        print(f"error over {summary['count']} points: geomean {summary['geomean_abs_error'] * 100:.1f} %, "
              f"worst {summary['worst_abs_error'] * 100:.1f} %")
    source = Path(args.report)
    out = Path(args.out) if args.out else (source if source.is_dir() else source.parent) / "predict.json"
    out.write_text(json.dumps({"report": str(source), "mode": "validate" if args.validate else "predict",
                               "calibrate_on": args.validate, "machine_per_node": args.machine_per_node,
                               "link": args.link, "rows": [r.to_dict() for r in rows], "errors": summary},
                              indent=2) + "\n")
    print(f"wrote {out}", file=sys.stderr)
    return 0
