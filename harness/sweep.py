"""Run a sweep: every point of a spec, `repeats` times, on one backend, into one JSON report.

For each point and repeat the backend starts a cluster with that point's config, runs it to its end,
samples the containers, collects every node's metrics and tears the cluster down. A failed run is
recorded with its error and the sweep goes on. The report is rewritten atomically after every run,
and Ctrl-C (or SIGTERM) tears the cluster down and leaves a report marked incomplete.
"""

from __future__ import annotations

import os
import signal
import threading
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

from harness import REPO_ROOT
from harness.errors import ClusterError, HarnessError
from harness.present.progress import (
    PlainProgress,
    RunInfo,
    SweepInfo,
    SweepProgress,
    choose_progress,
)
from harness.results.report import ReportWriter, utc_now
from harness.results.totals import repeat_held_out, repeat_totals
from harness.run.backend import Backend, default_timeout_s
from harness.run.loop import run_point
from harness.run.machine import commit_info, machine_info
from harness.analysis.sched_trace import SchedTrace
from harness.run.select import backend_class, select_backend
from harness.run.status import LIVE_SOURCES, Training, live_training_source
from harness.run.sysctls import HostSysctls
from harness.spec.points import SweepSpec
from wiiide.config import RunConfig

Progress = Callable[[str], None]

LIVE_POLL_S = 2.0  # how often the running point's coordinator progress is read (its log tail, from dockerd)

# Seconds a run costs besides its training (start-up, connecting, collecting, teardown), per backend, for the
# sweep's time estimate. local: 2.8-4.6 s measured for 1+2 processes on digits (a 3 s point, 3 repeats, load
# 1.9); docker: bench-overhead's fresh containers at 1+8 took 8.6 s (warm ones 0.4 s); swarm: not measured, a
# stack deploy per run.
RUN_OVERHEAD_S = {"local": 5.0, "docker": 10.0, "swarm": 30.0}


def run_estimate_s(config: RunConfig, backend_name: str) -> float:
    """Seconds one run of `config` is expected to take on `backend_name`: its `duration_s` (the bound of its
    training: max_steps or stop_at_target may end it sooner) plus `RUN_OVERHEAD_S` (10 s when unknown)."""
    return config.duration_s + RUN_OVERHEAD_S.get(backend_name, 10.0)


def check_sweep(spec: SweepSpec, backend: Backend | type, sched_trace: bool = False) -> None:
    """What a sweep checks before anything runs, beyond the spec's own validation (`load_spec`): every
    point's links and limits and the faults against `backend` (an instance or its class: the checks are
    classmethods), the scheduler trace's needs, root for host_sysctls.

    Raises:
        ClusterError: the backend cannot apply a point's cluster settings or a fault.
        HarnessError: `sched_trace` on a backend other than docker and local, or without root or tracefs;
            host_sysctls without root.
    """
    for p in spec.points:  # links and limits the backend cannot apply stop the sweep before anything runs
        backend.check_cluster(p.cluster)
    backend.check_faults(spec.faults)
    if sched_trace:  # the trace is of this machine's kernel: every node must run on it
        if backend.name not in ("docker", "local"):
            raise HarnessError(f"--sched-trace traces this machine's scheduler: the docker and local backends "
                               f"only, not {backend.name}")
        with SchedTrace():  # root, tracefs, the events: fail before anything runs
            pass
    if spec.host_sysctls and os.geteuid() != 0:
        raise HarnessError(f"{spec.source}: host_sysctls {spec.host_sysctls} need root; run as root or drop them")


def check_resumable(spec: SweepSpec, run_dir: Path, name: str, param_names: list[str]) -> None:
    """Raises HarnessError unless the report in `run_dir` (its sweep `name` and `param_names`) is of `spec`."""
    if name != spec.name or param_names != spec.param_names:
        raise HarnessError(f"{run_dir}: its report is of sweep {name!r} {param_names}, not {spec.name!r} "
                           f"{spec.param_names}")


class _LivePoller:
    """Reads `read()` every `interval_s` on a daemon thread and hands each `Training` to `update`."""

    def __init__(self, read: Callable[[], Training], update: Callable[[Training], None], interval_s: float) -> None:
        self._read, self._update, self._interval_s = read, update, interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="sweep live poller", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self._interval_s):
            self._update(self._read())

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


class _Interrupted(Exception):
    pass


def _raise_interrupted(signum, frame) -> None:
    raise _Interrupted(signal.Signals(signum).name)


def run_sweep(spec: SweepSpec, backend_name: str = "auto", results_dir: Path | None = None,
              progress: Progress | SweepProgress | None = None, backend: Backend | None = None,
              resume_dir: Path | None = None, reuse: bool = True, sched_trace: bool = False) -> Path:
    """Run `spec`; return the path of its report.json.

    `progress`: where the sweep says what it does: a `harness.present.progress.SweepProgress`, or a
    function of one line (plain lines, as `PlainProgress`); None: `choose_progress()` (a live rich
    display when stdout is a terminal, else plain lines on stderr).
    `resume_dir`: the folder of an interrupted run of the same spec; its finished points (every repeat
    ok) are kept and skipped; a point interrupted between its repeats keeps the repeats it has and runs
    the rest when its config is unchanged; the others run again into the same report.
    `reuse`: on docker, keep warm node containers between the runs of a cluster (`ComposeBackend`'s
    `reuse`; removed at the end, also after a failure or Ctrl-C); False: fresh containers per run.
    `sched_trace`: trace the machine's scheduler during every run and record in each repeat's ``sched``
    the cores it left idle while threads waited (`harness.analysis.sched_trace`; root, docker or local).

    Raises:
        ClusterError: the requested backend cannot be had (before anything runs).
        HarnessError: `resume_dir` holds no report of this spec; `sched_trace` on swarm, or without root
            or tracefs (`harness.analysis.sched_trace.SchedTraceError`, before anything runs).
    """
    display: SweepProgress
    if progress is None:
        display = choose_progress()
    elif callable(progress):
        display = PlainProgress(progress)
    else:
        display = progress
    note = display.note
    results_dir = Path(results_dir or REPO_ROOT / "results")
    if reuse and any(p.config.tls for p in spec.points):  # each TLS run mounts its own certificates
        note("tls: fresh containers for every run (warm containers are not reused)")
        reuse = False
    backend = backend or select_backend(backend_name, note, reuse=reuse)
    check_sweep(spec, backend, sched_trace)
    if resume_dir is not None:
        run_dir = Path(resume_dir).resolve()
        writer = ReportWriter.resume(run_dir / "report.json", commit_info())
        check_resumable(spec, run_dir, writer.report.name, writer.report.param_names)
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
    estimate_s = sum(run_estimate_s(p.config, backend.name) for p in spec.points) * spec.repeats
    display.start_sweep(SweepInfo(spec.name, len(spec.points), spec.repeats, backend.name, estimate_s,
                                  str(run_dir / "report.json"), LIVE_SOURCES.get(backend.name)))
    complete = False
    try:
        sysctls = HostSysctls(spec.host_sysctls).__enter__()  # restored in the finally below
        if spec.host_sysctls:
            writer.report.host_sysctls = sysctls.record()
            note(f"host sysctls for this sweep: {sysctls.record()} (restored at the end)")
        previous = {sig: signal.signal(sig, _raise_interrupted) for sig in (signal.SIGINT, signal.SIGTERM)}
        done = 0
        point = None
        try:
            for p in spec.points:
                if writer.finished_point(p.index, p.params, spec.repeats) is not None:
                    display.skip_point(p.index + 1, p.params)
                    done += spec.repeats
                    continue
                point = writer.start_point(p.index, p.params, p.config.to_dict(), cluster=p.cluster.to_dict(),
                                           keep_repeats=resume_dir is not None)
                done += len(point.repeats)  # an interrupted point's finished repeats, kept (resume)
                for repeat in range(len(point.repeats), spec.repeats):
                    run = RunInfo(done + 1, p.index + 1, repeat + 1, p.params, p.config.duration_s)
                    display.start_point(run)
                    out_dir = run_dir / f"point-{p.index:03d}" / f"repeat-{repeat}"
                    started = utc_now()
                    live_read = live_training_source(backend.name, out_dir)
                    poller = _LivePoller(live_read, display.live_update, LIVE_POLL_S) if live_read else None
                    try:
                        # profile: true traces the first repeat only (the profiler slows the steps it records)
                        config = p.config.replace(profile=False) if (repeat and p.config.profile) else p.config
                        result = run_point(backend, config, out_dir, spec.timeout_s or default_timeout_s(config),
                                           note, cluster=p.cluster, faults=spec.faults, sched_trace=sched_trace)
                        record = {"repeat": repeat, "status": result.status, "error": result.error,
                                  "started_at_utc": started, "elapsed_s": result.elapsed_s,
                                  "phases_s": result.phases_s, "sched": result.sched,
                                  "totals": repeat_totals(result.nodes, result.containers, result.links),
                                  "held_out": repeat_held_out(result.nodes),
                                  "nodes": result.nodes, "containers": result.containers,
                                  "links": result.links, "limits": result.limits, "faults": result.faults,
                                  "exit_codes": result.exit_codes,
                                  "logs_dir": str(Path(result.logs_dir).relative_to(run_dir)) if result.logs_dir else None}
                    except ClusterError as exc:
                        record = {"repeat": repeat, "status": "failed", "error": str(exc), "started_at_utc": started,
                                  "elapsed_s": None, "totals": {}, "nodes": {}, "containers": {}, "exit_codes": {}}
                    finally:
                        if poller is not None:
                            poller.stop()
                    rep = writer.add_repeat(point, record)
                    done += 1
                    shown = rep.model_dump(include={"status", "error", "totals"})
                    shown["nodes"] = {"coordinator": {"ps": (rep.nodes.get("coordinator") or {}).get("ps") or {}}}
                    display.end_point(run, shown)  # the totals, and the pieces a link probe chose
                writer.finish_point(point)
                point = None
            writer.finish(complete=True)
            complete = True
        except _Interrupted as exc:
            note(f"interrupted ({exc}): tearing the cluster down; the report keeps every finished run")
            backend.teardown()
            if point is not None:
                writer.finish_point(point, spec.repeats)
            writer.finish(complete=False, note=f"interrupted by {exc} after {done} of {total_runs} runs")
            raise KeyboardInterrupt from None
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            backend.teardown()
            close = getattr(backend, "close", None)  # swarm: leave a swarm the harness started; docker: warm containers
            if close is not None:
                close(note)
            sysctls.__exit__(None, None, None)
    finally:
        display.end_sweep(complete)
    return writer.path


def dry_run(spec: SweepSpec, backend_name: str = "auto", progress: Progress | None = None,
            resume_dir: Path | None = None, sched_trace: bool = False) -> str:
    """``sweep SPEC --dry-run``: check what `run_sweep` checks before it starts anything (`check_sweep` on the
    backend's class: nothing is built, started or written; a Docker engine is only asked whether it answers)
    and list the points and repeats with an estimate of the wall time; returns the text.

    One line per point: its index, params, repeats, the bound of its training (``duration_s``; ``max_steps``
    or ``stop_at_target`` may end it sooner), the estimate (repeats x (duration_s + `RUN_OVERHEAD_S` of the
    backend)) and the timeout per repeat; then the runs and the total, also at most (every repeat at its
    timeout). With `resume_dir`, the points its report finished are listed as done and cost nothing.

    Raises:
        ClusterError: the backend cannot be had (no engine for docker or swarm), or cannot apply a point's
            cluster settings or a fault.
        HarnessError: as `check_sweep`; `resume_dir` holds no report of this spec.
    """
    from harness.present.table import render_table
    from harness.results.report import load_report

    note = progress or (lambda line: None)
    backend = backend_class(backend_name, note)
    check_sweep(spec, backend, sched_trace)
    finished: set[int] = set()
    if resume_dir is not None:
        run_dir = Path(resume_dir).resolve()
        report = load_report(run_dir / "report.json")
        check_resumable(spec, run_dir, report.name, report.param_names)
        finished = {pt.index for pt in report.points if pt.status == "ok" and len(pt.repeats) >= spec.repeats}
    rows, runs, total_s, most_s = [], 0, 0.0, 0.0
    for p in spec.points:
        cfg = p.config
        params = ", ".join(f"{k}={v}" for k, v in p.params.items()) or "(base)"
        bound = f"{cfg.duration_s:g}" + (f" or {cfg.max_steps} steps" if cfg.max_steps else "") + \
            (" or the target" if cfg.stop_at_target else "")
        timeout_s = spec.timeout_s or default_timeout_s(cfg)
        if p.index in finished:
            rows.append((p.index, params, spec.repeats, bound, "done", "-"))
            continue
        estimate_s = spec.repeats * run_estimate_s(cfg, backend.name)
        runs, total_s, most_s = runs + spec.repeats, total_s + estimate_s, most_s + spec.repeats * timeout_s
        rows.append((p.index, params, spec.repeats, bound, f"{estimate_s:.0f}", f"{timeout_s:g}"))
    title = (f"sweep {spec.name} ({spec.source}): valid; {len(spec.points)} points x {spec.repeats} repeats on the "
             f"{backend.name} backend")
    footer = [f"{runs} runs, about {total_s / 60:.1f} min (at most {most_s / 60:.1f} min: every run at its timeout); "
              f"a run's estimate is duration_s + {RUN_OVERHEAD_S.get(backend.name, 10.0):g} s of start-up and "
              "teardown (harness.sweep.RUN_OVERHEAD_S)"]
    columns = ("#", "params", "repeats", "training s", "estimate s", "timeout s")
    return render_table(title, columns, rows, left_columns=("params", "training s"), footer=footer)
