"""The one loop that drives any `Backend` through one run: start, poll until every node has exited
or the timeout passes, inject faults meanwhile, stop, collect, tear down, judge.

Written once for every backend (`harness.run.compose`, `harness.run.local`, and a future
``harness.run.swarm``); a backend supplies only start / poll / stop / collect / teardown.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Sequence

from harness.errors import ClusterError, LinkShapingError
from harness.run.backend import (
    Backend,
    Collected,
    PhaseClock,
    Progress,
    RunResult,
    collect_nodes,
    default_timeout_s,
    judge,
)
from harness.run.faults import FaultInjector
from harness.analysis.sched_trace import SchedTrace, core_loss
from harness.run.watchdog import RankWatchdog
from harness.spec.cluster import ClusterSettings
from harness.spec.faults import Fault
from wiiide.config import RunConfig

POLL_INTERVAL_S = 0.25  # how often node states are read while a run goes on, on a backend that does not say
NOTE_INTERVAL_S = 10.0  # how often a "running: ..." progress line is written
FAULT_WAIT_MARGIN_S = 60.0  # seconds beyond connect_timeout_s that faults wait for training to start


def set_aside_leftovers(out_dir: Path) -> Path | None:
    """Move what an earlier attempt left in `out_dir` (a run interrupted and resumed into the same
    ``point-NNN/repeat-R`` folder) to the first free sibling ``<name>.interrupted-<n>``, so that the new
    run starts in an empty folder: its node metrics, logs and the watchdog's progress files must not
    mix with the old ones (a stale progress file made the watchdog see a stall). Nothing is deleted.

    Returns:
        The folder the leftovers went to, or None when `out_dir` is missing or empty.
    """
    out_dir = Path(out_dir)
    if not out_dir.is_dir() or not any(out_dir.iterdir()):
        return None
    n = 1
    while (aside := out_dir.with_name(f"{out_dir.name}.interrupted-{n}")).exists():
        n += 1
    out_dir.rename(aside)
    return aside


def run_point(backend: Backend, cfg: RunConfig, out_dir: Path, timeout_s: float | None = None,
              progress: Progress = print, cluster: ClusterSettings | None = None,
              faults: Sequence[Fault] = (), sched_trace: bool = False) -> RunResult:
    """Run one cluster with `cfg` on `backend` to its end and return what happened.

    Args:
        backend: any `harness.run.backend.Backend`.
        cfg: the point's node knobs.
        out_dir: the run's folder; node metrics go to ``out_dir/nodes``, logs to ``out_dir/logs``.
        timeout_s: seconds from the start (containers created, links shaped, training) after which
            the run is stopped and failed; None: `default_timeout_s(cfg)`.
        progress: receives one-line progress messages.
        cluster: the point's links, CPU and memory limits (None: nothing asked).
        faults: injected during the run, timed from the start of training (harness.run.faults).
        sched_trace: trace the machine's scheduler from before the nodes start to the end of the run
            and measure over the coordinator's timed steps the cores left idle while threads waited
            (`harness.analysis.sched_trace.core_loss`: ``RunResult.sched``); the nodes must share this
            machine's kernel (docker, local).

    Returns:
        A `RunResult`; ``status`` is ``failed`` with the cause when a node failed, the run timed out,
        or the nodes or links could not be set up. ``phases_s`` has the seconds of every phase.

    Raises:
        ClusterError: the backend cannot apply `cluster` or inject `faults` (checked before anything
            starts).
        SchedTraceError: `sched_trace` and the trace cannot be had (before anything starts).
    """
    backend.check_cluster(cluster)
    backend.check_faults(faults)
    out_dir = Path(out_dir).resolve()
    if (aside := set_aside_leftovers(out_dir)) is not None:
        progress(f"{out_dir.name}: an earlier attempt's files moved to {aside.name}")
    nodes_dir, logs_dir = out_dir / "nodes", out_dir / "logs"
    nodes_dir.mkdir(parents=True, exist_ok=True)
    logs_dir.mkdir(parents=True, exist_ok=True)
    timeout_s = timeout_s or default_timeout_s(cfg)
    tracer = SchedTrace() if sched_trace else None
    if tracer is not None:
        tracer.start()
    try:
        return _run(backend, cfg, out_dir, timeout_s, progress, cluster, faults, tracer)
    finally:
        if tracer is not None:
            tracer.close()  # also after a failure: the trace instance and a tracefs mount it made go


def _run(backend: Backend, cfg: RunConfig, out_dir: Path, timeout_s: float, progress: Progress,
         cluster: ClusterSettings | None, faults: Sequence[Fault], tracer: SchedTrace | None) -> RunResult:
    nodes_dir, logs_dir = out_dir / "nodes", out_dir / "logs"
    clock = PhaseClock()
    status, error = "ok", None
    injector: FaultInjector | None = None
    collected = Collected()
    try:
        controller = backend.start(cfg, out_dir, cluster or ClusterSettings(), progress, clock)
        injector = FaultInjector(list(faults), controller, nodes_dir,
                                 wait_s=cfg.connect_timeout_s + FAULT_WAIT_MARGIN_S).start()
        watchdog = RankWatchdog(cfg.engine, nodes_dir, cfg.stall_timeout_s, getattr(backend, "exit_code", None),
                                expected_dead=lambda: frozenset(injector.affected) if injector else frozenset())
        with clock.phase("run"):
            status, error = _wait_for_exit(backend, cfg, timeout_s, progress, clock, watchdog)
    except (ClusterError, LinkShapingError) as exc:
        status, error = "failed", str(exc)
    finally:
        if tracer is not None:
            tracer.stop()
        if injector is not None:
            injector.stop()
        try:
            with clock.phase("stop"):
                backend.stop()
            with clock.phase("collect"):
                collected = backend.collect(logs_dir, progress)
        finally:
            with clock.phase("teardown"):
                backend.teardown()
    nodes = collect_nodes(nodes_dir)
    sched = None
    if tracer is not None:
        with clock.phase("sched"):
            sched = timed_core_loss(tracer, nodes)
    judged_status, judged_error = judge(nodes, collected.exit_codes, cfg.num_workers,
                                        expected_dead=injector.affected if injector else frozenset(),
                                        expected_node_ids=injector.affected_node_ids if injector else frozenset())
    if status == "ok":
        status, error = judged_status, judged_error
    elif judged_error:
        error = f"{error}; {judged_error}"
    return RunResult(status, error, clock.elapsed_s(), nodes, collected.containers, collected.exit_codes,
                     str(logs_dir), links=collected.links, limits=collected.limits,
                     faults=injector.events if injector else [], phases_s=dict(clock.phases_s), sched=sched)


def _wait_for_exit(backend: Backend, cfg: RunConfig, timeout_s: float, progress: Progress,
                   clock: PhaseClock, watchdog: RankWatchdog | None = None) -> tuple[str, str | None]:
    """Poll `backend` every ``backend.poll_interval_s`` (default `POLL_INTERVAL_S`) until no node runs (``ok``), `watchdog` reports a dead or
    stalled rank, or `timeout_s` seconds have passed since `clock` started (``failed`` with the reason);
    a progress line every 10 s."""
    next_note_s = NOTE_INTERVAL_S
    while True:
        states = backend.poll()
        now_s = clock.elapsed_s()
        # first: a rank that died takes the others down within a poll; its exit is the cause to name
        verdict = watchdog.check(states, now_s) if watchdog is not None else None
        if verdict:
            progress(f"    {verdict}")
            return "failed", verdict
        if all(state in ("exited", "dead") for state in states.values()):
            return "ok", None
        if now_s > timeout_s:
            return "failed", f"timed out after {timeout_s:.0f} s; nodes still running were stopped"
        if now_s >= next_note_s:
            running = sum(state == "running" for state in states.values())
            progress(f"    running: {now_s:.0f} s of about {cfg.duration_s:.0f} s, {running} nodes up")
            next_note_s = now_s + NOTE_INTERVAL_S
        time.sleep(getattr(backend, "poll_interval_s", POLL_INTERVAL_S))


def timed_core_loss(tracer: SchedTrace, nodes: dict[str, dict]) -> dict:
    """`harness.analysis.sched_trace.core_loss` of `tracer`'s events over the coordinator's timed steps (its
    ``host_cpu_s`` window on CLOCK_MONOTONIC) as a report's ``sched``; ``{"error": ...}`` when the
    coordinator recorded no window (a failed run, or a node from before 2026-11-28, commit 30005ab) or
    the trace could not be read."""
    window = (nodes.get("coordinator") or {}).get("host_cpu_s") or {}
    start, end = window.get("start_monotonic_s"), window.get("end_monotonic_s")
    if not isinstance(start, (int, float)) or not isinstance(end, (int, float)) or end <= start:
        return {"error": "the coordinator recorded no timed window on CLOCK_MONOTONIC (host_cpu_s)"}
    try:
        return core_loss(tracer.lines(), float(start), float(end), os.cpu_count() or 1).to_dict()
    except (OSError, ValueError, KeyError) as exc:
        return {"error": f"reading the scheduler trace: {type(exc).__name__}: {exc}"}
