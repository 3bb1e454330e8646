"""``python -m harness VERB``: up, down, status, sweep, report, export, knobs, image, compare, round-model,
predict, timeline, bench-wire, bench-handshake, bench-tls, bench-overlay, hosts.

Errors the harness raises on purpose (bad spec, no engine, a failed Compose call) end as one line on
stderr and exit code 2 (bad input) or 1 (anything else), not a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import signal
import sys
from pathlib import Path
from typing import Any

from harness import REPO_ROOT
from harness.errors import HarnessError, SpecError
from wiiide.errors import ConfigError


def _log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _use_image(args: argparse.Namespace) -> None:
    """``--image REPO:TAG``: the node image the docker and swarm backends build and run (it becomes
    WIIIIIDE_IMAGE); on a swarm of several nodes, a tag in a registry they share (the swarm backend pushes it)."""
    import os
    if getattr(args, "image", None):
        os.environ["WIIIIIDE_IMAGE"] = args.image


def cmd_sweep(args: argparse.Namespace) -> int:
    """`sweep SPEC`: validate the spec, run every point and repeat, print the table and, last, the
    report's path; with --dry-run, only check and list the points with a time estimate
    (`harness.sweep.dry_run`). Raises SpecError/ConfigError (exit 2) before anything starts, HarnessError
    (exit 1)."""
    from harness.present.table import format_table
    from harness.results.report import load_report
    from harness.spec.points import load_spec, select_points
    from harness.sweep import run_sweep

    spec = load_spec(args.spec)  # validated before anything starts
    if args.only:
        select_points(spec, args.only)
    _use_image(args)
    if args.repeats:
        spec.repeats = args.repeats
    if args.dry_run:
        from harness.sweep import dry_run
        print(dry_run(spec, args.backend, _log, resume_dir=Path(args.resume) if args.resume else None,
                      sched_trace=args.sched_trace))
        return 0
    path = run_sweep(spec, args.backend, Path(args.results_dir) if args.results_dir else None,
                     resume_dir=Path(args.resume) if args.resume else None, reuse=args.reuse,
                     sched_trace=args.sched_trace)
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


UP_DEFAULT_DURATION_S = 300.0  # a long-running cluster trains for 5 minutes unless told otherwise


def _parse_set(items: list[str]) -> dict[str, Any]:
    """``["link=rate-100m", "cpus=0.5"]`` -> ``{"link": "rate-100m", "cpus": 0.5}``; each value is read
    as YAML (numbers, true/false, ``{rate: 100mbit}``), as it would be in a sweep spec.

    Raises:
        SpecError: an item has no ``=``, or its value is not valid YAML.
    """
    import yaml

    values: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise SpecError(f"--set {item!r}: expected key=value, e.g. --set link=rate-100m --set cpus=0.5")
        try:
            values[key.strip()] = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise SpecError(f"--set {item!r}: the value is not valid YAML: {exc}") from None
    return values


def up_point(args: argparse.Namespace):
    """The `harness.spec.points.Point` that ``up`` starts, validated exactly as a sweep point.

    Without ``--spec``: one point of ``base: {num_workers: --workers (2), duration_s: --duration-s
    (300), **--set}``. With ``--spec FILE --point N``: point N (0-based) of that spec, with ``--set``
    values (and ``--workers`` / ``--duration-s`` when given) put in its ``base`` first.

    Raises:
        SpecError: a bad key or value (naming it and what is allowed), a --set key that is one of
            the spec's axes, N out of range, or a spec with faults or host_sysctls (sweeps only).
    """
    import yaml

    from harness.spec.points import build_spec

    sets = _parse_set(args.set or [])
    shortcuts = {"num_workers": args.workers, "duration_s": args.duration_s}
    for key, value in shortcuts.items():
        if value is not None:
            if key in sets and sets[key] != value:
                raise SpecError(f"--set {key}={sets[key]} and --{key.replace('num_', '').replace('_', '-')} "
                                f"{value} disagree: give one")
            sets[key] = value
    if args.spec is None:
        if args.point is not None:
            raise SpecError("--point N chooses a point of --spec FILE: give the spec too")
        data: dict[str, Any] = {"name": "cluster", "base": {"num_workers": 2, "duration_s": UP_DEFAULT_DURATION_S,
                                                             **sets}}
        source = "--set"
    else:
        source = str(args.spec)
        try:
            data = yaml.safe_load(Path(args.spec).read_text())
        except (OSError, yaml.YAMLError) as exc:
            raise SpecError(f"{source}: cannot read the spec: {exc}") from None
        if not isinstance(data, dict):
            raise SpecError(f"{source}: expected a mapping (a sweep spec)")
        axes = data.get("axes") or {}
        clash = sorted(set(sets) & set(axes))
        if clash:
            raise SpecError(f"--set {clash[0]}: {clash[0]} is an axis of {source}; choose its value with --point N")
        data = {**data, "base": {**(data.get("base") or {}), **sets}}
    spec = build_spec(data, source)
    if spec.faults or spec.host_sysctls:
        raise SpecError(f"{source}: faults and host_sysctls are for sweeps (`wiiide-lab sweep`); "
                        f"`up` starts a cluster and leaves it running")
    index = args.point if args.point is not None else 0
    if not 0 <= index < len(spec.points):
        raise SpecError(f"--point {index}: {source} has points 0..{len(spec.points) - 1}")
    return spec.points[index]


def cmd_export(args: argparse.Namespace) -> int:
    """`export REPORT --format csv|parquet [--table T] [--out DIR]`: the report's tables as files, their
    paths printed (`harness.results.export`). Raises HarnessError for an unreadable report."""
    from harness.results.export import main

    return main(args)


def cmd_up(args: argparse.Namespace) -> int:
    from harness.run.backend import PhaseClock
    from harness.run.select import select_backend

    point = up_point(args)  # validated before anything starts
    _use_image(args)
    backend = select_backend(args.backend, _log)
    results = (REPO_ROOT / "results" / "cluster").resolve()
    (results / "nodes").mkdir(parents=True, exist_ok=True)
    clock = PhaseClock()
    containers = backend.launch(point.config, results, point.cluster, _log, clock)
    for c in containers:
        c.reload()
        print(f"{c.name}\t{c.status}" + (f"\tnode {c.node}" if args.backend == "swarm" else ""))
    cfg = point.config
    cluster = point.cluster
    asked = [f"link {cluster.link.label}"] if cluster.link else []
    for name, values in (("cpus", cluster.cpus), ("mem_limit", cluster.mem_limit)):
        if values is not None:
            asked.append(f"{name} " + " ".join(f"{k}={v}" for k, v in values.values.items()))
    _log(f"cluster up in {clock.elapsed_s():.1f} s ({', '.join(f'{k} {v:.1f} s' for k, v in clock.phases_s.items())}): "
         f"1 coordinator + {cfg.num_workers} workers training for {cfg.duration_s:g} s; "
         f"{', '.join(asked) or 'no links or limits'}; "
         f"node metrics in {results / 'nodes'}; `make cluster-down{' BACKEND=swarm' if args.backend == 'swarm' else ''}` "
         "removes it")
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    from harness.run.compose_project import cluster_down
    from harness.run.docker_client import engine_problem
    problem = engine_problem()
    if problem:
        _log(f"no Docker engine answered ({problem}): nothing to remove")
        return 0
    if args.backend == "swarm":
        from harness.run import swarm
        swarm.cluster_down(_log)
        _log(f"stack down: no service, task, network or secret of stack {swarm.stack_name()} is left, and a "
             "swarm the harness started has been left")
        return 0
    cluster_down(_log)
    _log("cluster down: no container or network of the project is left (their qdiscs and ifb devices "
         "lived in the containers' network namespaces and went with them)")
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


# the bench-* verbs: (module with add_arguments / main_from_args, help); each writes its JSON and prints its table
BENCHES = {
    "bench-wire": ("harness.bench.wire.cli", "raw socket vs WIIIIIDE frames, codecs, policies on paced links (JSON)"),
    "bench-overhead": ("harness.bench.overhead", "the harness's own seconds per point, phase by phase, "
                                                 "at 1+4 and 1+8 containers (JSON)"),
    "bench-handshake": ("harness.bench.handshake", "a worker's admission time and samples/s under a slowloris and "
                                                   "a connection flood, each beside an unattacked twin (JSON)"),
    "bench-tls": ("harness.bench.tls", "goodput of 1 MiB frames over TLS 1.3 against plaintext, side by side (JSON)"),
    "bench-link": ("harness.bench.link_loss", "the link fallback without netem between two containers: loss "
                                              "(asked, counted by iptables and by UDP), the delay line's round "
                                              "trips and TCP capacity (JSON)"),
    "bench-overlay": ("harness.bench.overlay", "goodput of 1 MiB frames on a swarm's encrypted overlay against a "
                                               "plain one, side by side (JSON)"),
}


def cmd_bench(args: argparse.Namespace) -> int:
    """A `bench-*` verb: its module's `main_from_args` (see `BENCHES`), with SIGTERM (`timeout`, `kill`)
    unwinding as Ctrl-C does (exit 130, containers removed)."""
    from harness.bench import sigterm_as_interrupt

    previous = signal.signal(signal.SIGTERM, sigterm_as_interrupt)
    try:
        return importlib.import_module(args.bench_module).main_from_args(args, _log)
    finally:
        signal.signal(signal.SIGTERM, previous)


def cmd_image(args: argparse.Namespace) -> int:
    """`image [--force]`: build the node image and print its tag. Raises ClusterError without an engine."""
    from harness.run.image import build_image
    print(build_image(force=args.force, log=_log))
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    """`compare REPORT [REPORT]`: ratios against a baseline engine or report, with Welch's t-test p-values."""
    from harness.present.compare import compare
    print(compare(args.reports, args.metric, args.baseline, args.alpha, args.json, args.pool))
    return 0


def cmd_round_model(args: argparse.Namespace) -> int:
    """`round-model REPORT`: the step-time model of each shaped point beside its measured step
    (`harness.analysis.round_table`); exit 2 when REPORT is not a readable sweep report."""
    from harness.analysis.round_table import main_from_args
    return main_from_args(args)


def cmd_predict(args: argparse.Namespace) -> int:
    """`predict REPORT --workers 16,64`: step time and samples/s at more workers from a measured run
    (`harness.analysis.predict_cli`); exit 2 when REPORT is unreadable or has nothing to calibrate on."""
    from harness.analysis.predict_cli import main_from_args
    return main_from_args(args)


def cmd_timeline(args: argparse.Namespace) -> int:
    """`timeline REPORT`: one repeat's spans (a sweep run with trace_steps) as a Chrome trace
    (`harness.present.timeline`); exit 2 when there is nothing to write."""
    from harness.present.timeline import main_from_args
    return main_from_args(args)


def cmd_knobs(args: argparse.Namespace) -> int:
    """`knobs [--group G] [--markdown]`: the knobs reference (`harness.present.knobs`): rich tables on a
    terminal, one tab-separated line per knob otherwise, docs/knobs.md's Markdown with --markdown.
    Raises SpecError (exit 2) for an unknown group, naming the groups."""
    from harness.present import knobs

    if args.markdown:
        sys.stdout.write(knobs.knobs_markdown(args.group))
    elif sys.stdout.isatty():
        from rich.console import Console
        console = Console()
        for table in knobs.knobs_rich(args.group):
            console.print(table)
    else:
        try:
            print(knobs.knobs_lines(args.group), flush=True)
        except BrokenPipeError:  # `wiiide-lab knobs | head`: the reader had enough
            import os
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every verb (`wiiide-lab --help`, `wiiide-lab VERB --help`)."""
    parser = argparse.ArgumentParser(prog="wiiide-lab", description="WIIIIIDE lab: run, shape, sweep and report WIIIIIDE clusters (also: python -m harness)")
    sub = parser.add_subparsers(dest="verb", required=True)

    p = sub.add_parser("sweep", help="run a sweep spec and write its JSON report")
    p.add_argument("spec", help="a YAML sweep spec, e.g. experiments/quick.yaml")
    p.add_argument("--backend", choices=["auto", "docker", "swarm", "local"], default="auto",
                   help="auto: docker when an engine answers, else local (default); swarm: a stack per run on "
                        "Docker Swarm (a single-node swarm is started and left again when the engine is in none)")
    p.add_argument("--repeats", type=int, help="override the spec's repeats")
    p.add_argument("--only", action="append", metavar="AXIS=GLOB[,GLOB]",
                   help="run only the points whose AXIS value (or label) matches a glob, e.g. model=lm-*,mlp-*; "
                        "repeat for several axes (every one must match)")
    p.add_argument("--image", metavar="REPO:TAG", help="the node image (default: $WIIIIIDE_IMAGE or wiiide:latest); "
                                                        "with a swarm of several nodes, a registry tag they can pull")
    p.add_argument("--results-dir", help="where results/<name>-<timestamp>/ go (default: results/)")
    p.add_argument("--resume", metavar="DIR",
                   help="continue an interrupted run of this spec in DIR: finished points are skipped")
    p.add_argument("--no-reuse", dest="reuse", action="store_false",
                   help="docker: fresh containers for every run (default: warm containers are kept between the "
                        "runs of the same cluster and each run forks fresh node processes in them; see docs/getting-started.md)")
    p.add_argument("--dry-run", action="store_true",
                   help="check everything the sweep checks before it starts (spec, every point's config, links, "
                        "cluster settings, faults, sysctls, the backend's own checks) and list the points and "
                        "repeats with an estimate of the time; starts no container or process")
    p.add_argument("--sched-trace", action="store_true",
                   help="trace this machine's scheduler (tracefs, root; docker and local) and record per repeat the "
                        "cores it left idle while threads waited ('sched'; the round model's 'lost cores')")
    p.set_defaults(func=cmd_sweep)

    p = sub.add_parser("report", help="print reports as tables (default: the newest); --html: a page with charts")
    p.add_argument("paths", nargs="*", metavar="PATH",
                   help="report.json files or their folders; with --html, several are compared on the same axes")
    p.add_argument("--html", action="store_true",
                   help="also write a self-contained HTML page (report.html next to the report, or "
                        "compare-<others>.html next to the first for several) and print its path last")
    p.add_argument("--out", help="where the HTML page goes (with --html)")
    p.set_defaults(func=cmd_report)

    from harness.results.export import add_arguments as export_arguments
    p = sub.add_parser("export", help="a report's tables (repeats, nodes, stats, evals) as CSV or Parquet files "
                                      "for pandas and notebooks")
    export_arguments(p)
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("up", help="start a long-running cluster in containers with a sweep point's knobs "
                                  "(1 coordinator + N workers, links shaped, limits set, then training)")
    p.add_argument("--workers", type=int, help="number of workers (default 2; = --set num_workers=N)")
    p.add_argument("--duration-s", type=float,
                   help=f"how long the cluster trains, s (default {UP_DEFAULT_DURATION_S:g}; = --set duration_s=S)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="any RunConfig field or cluster key as in a spec's base, e.g. --set link=rate-100m "
                        "--set cpus=0.5 --set compression=zlib-1 (repeatable; values read as YAML)")
    p.add_argument("--spec", help="a sweep spec whose point --point N to start (with its links and limits)")
    p.add_argument("--point", type=int, help="0-based index of the spec's point (default 0)")
    p.add_argument("--backend", choices=["docker", "swarm"], default="docker",
                   help="docker: containers from compose.yaml (default); swarm: a stack on Docker Swarm")
    p.add_argument("--image", metavar="REPO:TAG", help="the node image (a registry tag the swarm's nodes can "
                                                        "pull when there are several)")
    p.set_defaults(func=cmd_up)

    p = sub.add_parser("down", help="remove the cluster's containers and network")
    p.add_argument("--backend", choices=["docker", "swarm"], default="docker",
                   help="swarm: remove the project's stack and leave a swarm the harness started")
    p.set_defaults(func=cmd_down)

    p = sub.add_parser("status", help="show the running cluster live: every node's state, step, batches/s, "
                                      "and every container's CPU, memory and network (Engine API)")
    p.add_argument("--once", action="store_true", help="print one snapshot and exit")
    p.add_argument("--interval-s", type=float, default=2.0, help="seconds between refreshes (default 2)")
    p.set_defaults(func=cmd_status)

    for verb, (module, help_text) in BENCHES.items():
        p = sub.add_parser(verb, help=help_text)
        importlib.import_module(module).add_arguments(p)
        p.set_defaults(func=cmd_bench, bench_module=module)

    p = sub.add_parser("knobs", help="the knobs reference: every RunConfig field by subsystem, with what it does, "
                                     "its unit, default and allowed values")
    p.add_argument("--group", metavar="G", help="only this group (e.g. sockets); an unknown one lists the groups")
    p.add_argument("--markdown", action="store_true", help="print Markdown (docs/knobs.md is this output)")
    p.set_defaults(func=cmd_knobs)

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
    p.add_argument("--pool", metavar="AXIS", help="one report: pool the points that differ only in AXIS (e.g. "
                                                  "seed) into one sample per engine")
    p.set_defaults(func=cmd_compare)

    from harness.analysis.round_table import add_arguments as round_model_arguments
    p = sub.add_parser("round-model", help="the step-time model of a report's points on shaped links beside "
                                           "their measured steps (sharded servers, DDP)")
    round_model_arguments(p)
    p.set_defaults(func=cmd_round_model)

    from harness.analysis.predict_cli import add_arguments as predict_arguments
    p = sub.add_parser("predict", help="step time and samples/s at more workers (central, sharded, ring "
                                       "all-reduce, local SGD) from a measured report; --validate: against it")
    predict_arguments(p)
    p.set_defaults(func=cmd_predict)

    from harness.present.timeline import add_arguments as timeline_arguments
    p = sub.add_parser("timeline", help="one repeat's steps (a sweep run with trace_steps) as a Chrome trace "
                                        "for Perfetto: per node the compute, pushes, pulls, updates and waits")
    timeline_arguments(p)
    p.set_defaults(func=cmd_timeline)
    from harness.hosts.cli import register  # the `hosts` verb, and --hosts on sweep, up and down
    register(sub)
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
