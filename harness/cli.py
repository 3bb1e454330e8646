"""``python -m harness VERB``: up, down, status, sweep, report, image, compare, bench-wire.

Errors the harness raises on purpose (bad spec, no engine, a failed Compose call) end as one line on
stderr and exit code 2 (bad input) or 1 (anything else), not a traceback.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from harness import REPO_ROOT
from harness.errors import HarnessError, SpecError
from wiiide.errors import ConfigError


def _log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def cmd_sweep(args: argparse.Namespace) -> int:
    """`sweep SPEC`: validate the spec, run every point and repeat, print the table and, last, the
    report's path. Raises SpecError/ConfigError (exit 2) before anything starts, HarnessError (exit 1)."""
    from harness.present.table import format_table
    from harness.results.report import load_report
    from harness.spec.points import load_spec
    from harness.sweep import run_sweep

    spec = load_spec(args.spec)  # validated before anything starts
    if args.repeats:
        spec.repeats = args.repeats
    path = run_sweep(spec, args.backend, Path(args.results_dir) if args.results_dir else None,
                     resume_dir=Path(args.resume) if args.resume else None)
    print(format_table(load_report(path)))
    print(path)
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    """`report [PATH...] [--html] [--out FILE]`: each report as a table and its path; with --html the
    page's path last. Raises SpecError for --out without --html, HarnessError for an unreadable report."""
    from harness.present.table import format_table
    from harness.results.report import load_report, newest_report
    if args.out and not args.html:
        raise SpecError("--out names the HTML page: use it with --html")
    paths = [Path(p) for p in args.paths] or [newest_report(REPO_ROOT / "results")]
    paths = [p if p.name == "report.json" or not p.is_dir() else p / "report.json" for p in paths]
    for path in paths:
        print(format_table(load_report(path)))
        print(path)
    if args.html:
        from harness.present.html import write_html
        print(write_html(paths, args.out))
    return 0


def cmd_up(args: argparse.Namespace) -> int:
    from harness.run.compose import cluster_up
    from harness.run.docker_client import engine_problem
    from harness.run.image import ensure_image
    from wiiide.config import RunConfig

    problem = engine_problem()
    if problem:
        raise HarnessError(f"no Docker engine answered ({problem}); start one with `make docker-engine`")
    ensure_image(log=_log)
    cfg = RunConfig(num_workers=args.workers, duration_s=args.duration_s)
    results = (REPO_ROOT / "results" / "cluster").resolve()
    containers = cluster_up(cfg, results)
    for c in containers:
        print(f"{c.name}\t{c.status}")
    _log(f"cluster up: 1 coordinator + {args.workers} workers training for {args.duration_s:g} s; "
         f"node metrics in {results / 'nodes'}; `make cluster-down` removes it")
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    from harness.run.compose import cluster_down
    from harness.run.docker_client import engine_problem
    problem = engine_problem()
    if problem:
        _log(f"no Docker engine answered ({problem}): nothing to remove")
        return 0
    cluster_down(_log)
    _log("cluster down: no container or network of the project is left")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    """`status`: the running cluster (Compose project WIIIIIDE_PROJECT), live on a terminal, plain text
    otherwise. Raises ClusterError (exit 1) when no engine answers or the project has no container,
    SpecError (exit 2) for an interval <= 0."""
    from rich.console import Console

    from harness.present.status import watch_status
    from harness.run.docker_client import docker_client
    from harness.run.status import read_cluster_status

    if args.interval_s <= 0:
        raise SpecError(f"--interval-s must be > 0 seconds, got {args.interval_s:g}")
    client = docker_client(timeout_s=30)
    return watch_status(lambda: read_cluster_status(client), Console(), args.interval_s, once=args.once)


def cmd_bench_wire(args: argparse.Namespace) -> int:
    """`bench-wire`: see `harness.bench.wire.cli`; writes its JSON and prints the tables."""
    from harness.bench.wire.cli import main_from_args
    return main_from_args(args, _log)


def cmd_image(args: argparse.Namespace) -> int:
    """`image [--force]`: build the node image and print its tag. Raises ClusterError without an engine."""
    from harness.run.image import build_image
    print(build_image(force=args.force, log=_log))
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    """`compare REPORT [REPORT]`: ratios against a baseline engine or report, with Welch's t-test p-values."""
    from harness.present.compare import compare
    print(compare(args.reports, args.metric, args.baseline, args.alpha, args.json))
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every verb (`wiiide-lab --help`, `wiiide-lab VERB --help`)."""
    parser = argparse.ArgumentParser(prog="wiiide-lab", description="WIIIIIDE lab: run, shape, sweep and report WIIIIIDE clusters (also: python -m harness)")
    sub = parser.add_subparsers(dest="verb", required=True)

    p = sub.add_parser("sweep", help="run a sweep spec and write its JSON report")
    p.add_argument("spec", help="a YAML sweep spec, e.g. experiments/quick.yaml")
    p.add_argument("--backend", choices=["auto", "docker", "local"], default="auto",
                   help="auto: docker when an engine answers, else local (default)")
    p.add_argument("--repeats", type=int, help="override the spec's repeats")
    p.add_argument("--results-dir", help="where results/<name>-<timestamp>/ go (default: results/)")
    p.add_argument("--resume", metavar="DIR",
                   help="continue an interrupted run of this spec in DIR: finished points are skipped")
    p.set_defaults(func=cmd_sweep)

    p = sub.add_parser("report", help="print reports as tables (default: the newest); --html: a page with charts")
    p.add_argument("paths", nargs="*", metavar="PATH",
                   help="report.json files or their folders; with --html, several are compared on the same axes")
    p.add_argument("--html", action="store_true",
                   help="also write a self-contained HTML page (report.html next to the report, or "
                        "compare-<others>.html next to the first for several) and print its path last")
    p.add_argument("--out", help="where the HTML page goes (with --html)")
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("up", help="start a cluster in containers (1 coordinator + N workers)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--duration-s", type=float, default=300.0, help="how long the cluster trains (s)")
    p.set_defaults(func=cmd_up)

    p = sub.add_parser("down", help="remove the cluster's containers and network")
    p.set_defaults(func=cmd_down)

    p = sub.add_parser("status", help="show the running cluster live: every node's state, step, batches/s, "
                                      "and every container's CPU, memory and network (Engine API)")
    p.add_argument("--once", action="store_true", help="print one snapshot and exit")
    p.add_argument("--interval-s", type=float, default=2.0, help="seconds between refreshes (default 2)")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("bench-wire", help="raw socket vs WIIIIIDE frames, codecs, policies on paced links (JSON)")
    from harness.bench.wire.cli import add_arguments
    add_arguments(p)
    p.set_defaults(func=cmd_bench_wire)

    p = sub.add_parser("image", help="build the node image (wheelhouse, local base when no registry)")
    p.add_argument("--force", action="store_true")
    p.set_defaults(func=cmd_image)

    p = sub.add_parser("compare", help="engines of one report against a baseline engine, or report B against A, "
                                       "with ratios and Welch's t-test over the repeats")
    p.add_argument("reports", nargs="+", metavar="REPORT", help="one or two report.json files or their folders")
    p.add_argument("--metric", default="throughput_samples_per_s",
                   help="a key of the repeats' totals (default: the guide's throughput, samples/s)")
    p.add_argument("--baseline", help="engine label the others are set against (default: ddp, else the first)")
    p.add_argument("--alpha", type=float, default=0.05, help="significance level of the t-test (default 0.05)")
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    p.set_defaults(func=cmd_compare)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one verb; return its exit code: 0 ok, 1 a HarnessError, 2 bad input (SpecError, ConfigError,
    or an argument error from argparse), 130 Ctrl-C. Errors end as one line on stderr, not a traceback."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (SpecError, ConfigError) as exc:
        _log(f"error: {exc}")
        return 2
    except HarnessError as exc:
        _log(f"error: {exc}")
        return 1
    except KeyboardInterrupt:
        _log("interrupted")
        return 130
