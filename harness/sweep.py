"""Run a sweep: every point of a spec, `repeats` times, on one backend, into one JSON report.

For each point and repeat the backend starts a cluster with that point's config, runs it to its end,
samples the containers, collects every node's metrics and tears the cluster down. A failed run is
recorded with its error and the sweep goes on. The report is rewritten atomically after every run,
and Ctrl-C (or SIGTERM) tears the cluster down and leaves a report marked incomplete.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

from harness import REPO_ROOT
from harness.errors import ClusterError, HarnessError
from harness.results.report import ReportWriter, utc_now
from harness.results.totals import link_totals, run_totals
from harness.run.backend import Backend, default_timeout_s
from harness.run.loop import run_point
from harness.run.machine import commit_info, machine_info
from harness.run.select import select_backend
from harness.run.sysctls import HostSysctls
from harness.spec.points import SweepSpec

Progress = Callable[[str], None]


def _print(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class _Interrupted(Exception):
    pass


def _raise_interrupted(signum, frame) -> None:
    raise _Interrupted(signal.Signals(signum).name)


def run_sweep(spec: SweepSpec, backend_name: str = "auto", results_dir: Path | None = None,
              progress: Progress = _print, backend: Backend | None = None, resume_dir: Path | None = None) -> Path:
    """Run `spec`; return the path of its report.json.

    `resume_dir`: the folder of an interrupted run of the same spec; its finished points are kept and
    skipped, the others run again into the same report.

    Raises:
        ClusterError: the requested backend cannot be had (before anything runs).
        HarnessError: `resume_dir` holds no report of this spec.
    """
    results_dir = Path(results_dir or REPO_ROOT / "results")
    backend = backend or select_backend(backend_name, progress)
    for p in spec.points:  # links and limits the backend cannot apply stop the sweep before anything runs
        backend.check_cluster(p.cluster)
    backend.check_faults(spec.faults)
    if spec.host_sysctls and os.geteuid() != 0:
        raise HarnessError(f"{spec.source}: host_sysctls {spec.host_sysctls} need root; run as root or drop them")
    if resume_dir is not None:
        run_dir = Path(resume_dir).resolve()
        writer = ReportWriter.resume(run_dir / "report.json")
        if writer.data.get("name") != spec.name or writer.data.get("param_names") != spec.param_names:
            raise HarnessError(f"{run_dir}: its report is of sweep {writer.data.get('name')!r} "
                               f"{writer.data.get('param_names')}, not {spec.name!r} {spec.param_names}")
    else:
        stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        run_dir = (results_dir / f"{spec.name}-{stamp}").resolve()
        run_dir.mkdir(parents=True, exist_ok=False)
        writer = ReportWriter(run_dir / "report.json", {
            "name": spec.name, "machine_info": machine_info(), "commit_info": commit_info(),
            "backend": backend.describe(), "spec": spec.to_dict(), "param_names": spec.param_names,
        })
    writer.save()
    total_runs = len(spec.points) * spec.repeats
    estimate_s = sum(p.config.duration_s + 10 for p in spec.points) * spec.repeats
    progress(f"sweep {spec.name}: {len(spec.points)} points x {spec.repeats} repeats on the {backend.name} "
             f"backend, about {estimate_s / 60:.1f} min; report: {run_dir / 'report.json'}")
    sysctls = HostSysctls(spec.host_sysctls).__enter__()  # restored in the finally below
    if spec.host_sysctls:
        writer.data["host_sysctls"] = sysctls.record()
        progress(f"host sysctls for this sweep: {sysctls.record()} (restored at the end)")
    previous = {sig: signal.signal(sig, _raise_interrupted) for sig in (signal.SIGINT, signal.SIGTERM)}
    done, t_start = 0, time.monotonic()
    point = None
    try:
        for p in spec.points:
            if writer.finished_point(p.index, p.params) is not None:
                progress(f"skipping point {p.index + 1}/{len(spec.points)} {p.params}: finished in the run resumed")
                done += spec.repeats
                continue
            point = writer.start_point(p.index, p.params, p.config.to_dict())
            point["cluster"] = p.cluster.to_dict()  # link profiles, cpus, mem_limit as asked
            for repeat in range(spec.repeats):
                elapsed = time.monotonic() - t_start
                left = (elapsed / done * (total_runs - done)) if done else estimate_s
                progress(f"[{done + 1}/{total_runs}] point {p.index + 1}/{len(spec.points)} {p.params} "
                         f"repeat {repeat + 1}/{spec.repeats}, about {left / 60:.1f} min left")
                out_dir = run_dir / f"point-{p.index:03d}" / f"repeat-{repeat}"
                started = utc_now()
                try:
                    # profile: true traces the first repeat only (the profiler slows the steps it records)
                    config = p.config.replace(profile=False) if (repeat and p.config.profile) else p.config
                    result = run_point(backend, config, out_dir, spec.timeout_s or default_timeout_s(config),
                                       progress, cluster=p.cluster, faults=spec.faults)
                    record = {"repeat": repeat, "status": result.status, "error": result.error,
                              "started_at_utc": started, "elapsed_s": result.elapsed_s,
                              "phases_s": result.phases_s,
                              "totals": {**run_totals(result.nodes, result.containers),
                                         **link_totals(result.links, result.nodes)},
                              "nodes": result.nodes, "containers": result.containers,
                              "links": result.links, "limits": result.limits, "faults": result.faults,
                              "exit_codes": result.exit_codes,
                              "logs_dir": str(Path(result.logs_dir).relative_to(run_dir)) if result.logs_dir else None}
                except ClusterError as exc:
                    record = {"repeat": repeat, "status": "failed", "error": str(exc), "started_at_utc": started,
                              "elapsed_s": None, "totals": {}, "nodes": {}, "containers": {}, "exit_codes": {}}
                writer.add_repeat(point, record)
                done += 1
                totals = record["totals"]
                if record["status"] == "ok":
                    progress(f"    ok: {totals['batches_per_s']:.0f} batches/s, "
                             f"{(totals['goodput_bytes_per_s'] or 0) / 1e6:.2f} MB/s goodput, "
                             f"held-out accuracy {100 * (totals['test_accuracy'] or 0):.1f} %")
                else:
                    progress(f"    FAILED: {record['error']}")
            writer.finish_point(point)
            point = None
        writer.finish(complete=True)
    except _Interrupted as exc:
        progress(f"interrupted ({exc}): tearing the cluster down; the report keeps every finished run")
        backend.teardown()
        if point is not None:
            writer.finish_point(point)
        writer.finish(complete=False, note=f"interrupted by {exc} after {done} of {total_runs} runs")
        raise KeyboardInterrupt from None
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        backend.teardown()
        sysctls.__exit__(None, None, None)
    return writer.path
