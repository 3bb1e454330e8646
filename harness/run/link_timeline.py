"""Applies changing link profiles (`harness.spec.timeline.TimedProfile`) on their timeline during a run
and records when each change took effect.

One thread per shaped container (or per pair class) with a timeline: it waits until the step's time
since the start gate opened, runs the step's commands (`harness.links.schedule.change_commands`) with
the container's runner (the host's ``nsenter`` where the counters use it, else an Engine API exec),
and appends a record to the container's ``links`` record::

    {"at_s": 20.0, "applied_at_s": 20.013, "took_s": 0.011, "changes": {"rate_bps": 100000000},
     "read_back_rate_bps": 100000000}

``applied_at_s`` is when the last command of the step returned (seconds since the gate opened);
``read_back_rate_bps`` is the rate tc reports for the changed class right after (schedules of up to
`READ_BACK_MAX_CHANGES` changes; a trace's many changes are read back by the counter reads instead).
A step whose command fails records ``error`` with tc's message, and the timeline goes on. A change
falls behind when the one before took longer than the gap between them: it then runs at once (its
``applied_at_s`` says by how much it was late); none is skipped. `stop` ends every thread; steps not
reached by then are not recorded.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from harness.errors import LinkShapingError
from harness.links.schedule import change_commands, profile_after
from harness.run.tc_exec import read_back
from harness.spec.timeline import TimedProfile

READ_BACK_MAX_CHANGES = 50
MAX_CHANGES_KEPT = 5000  # records kept per target (a looping 100 ms trace makes 10 a second)


@dataclass
class TimelineTarget:
    """One tree to change: the container's runner, its profile with the timeline, where the class is
    (`dev`, `classid`, `netem_handle`) and the list its change records go to (`records`)."""

    name: str
    runner: Any
    profile: TimedProfile
    records: list[dict[str, Any]]
    dev: str = "eth0"
    classid: str = "1:1"
    netem_handle: str = "10:"
    read_back: bool = field(default=False)


def _rate_read_back(runner: Any, target: TimelineTarget) -> int | None:
    """The rate (bit/s) tc reports for the target's class (htb) or root (tbf), or None."""
    handle = "1:" if target.profile.root_qdisc == "tbf" else target.classid
    records = read_back(runner, [target.dev])[target.dev]
    return next((r.get("rate_bps") for r in records if r.get("handle") == handle and r.get("rate_bps")), None)


class LinkTimeline:
    """The timelines of one run. `add` targets, `start` when the gate opens, `stop` when the run ends."""

    def __init__(self) -> None:
        self.targets: list[TimelineTarget] = []
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def add(self, target: TimelineTarget) -> None:
        """Add one target (before `start`); a finite timeline of few changes is read back after each."""
        target.read_back = (target.profile.period_s is None
                            and len(target.profile.timeline) <= READ_BACK_MAX_CHANGES)
        self.targets.append(target)

    def start(self, gate_monotonic_s: float) -> None:
        """Start one thread per target; step times count from `gate_monotonic_s` (time.monotonic)."""
        for target in self.targets:
            thread = threading.Thread(target=self._run, args=(target, gate_monotonic_s), daemon=True,
                                      name=f"link-timeline-{target.name}")
            thread.start()
            self._threads.append(thread)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop every thread (a command under way finishes first). Raises nothing."""
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=timeout_s)
        self._threads = []

    def _run(self, target: TimelineTarget, gate_s: float) -> None:
        current = profile_after(target.profile, {})
        for at_s, changes in target.profile.iter_changes():
            wait_s = gate_s + at_s - time.monotonic()
            if self._stop.wait(max(0.0, wait_s)):
                return
            current = profile_after(current, changes)
            record: dict[str, Any] = {"at_s": round(at_s, 6), "changes": dict(changes)}
            started = time.monotonic()
            try:
                for argv in change_commands(current, set(changes), target.dev, target.classid, target.netem_handle):
                    target.runner.run(argv)
                done = time.monotonic()
                if target.read_back:
                    record["read_back_rate_bps"] = _rate_read_back(target.runner, target)
            except LinkShapingError as exc:
                done = time.monotonic()
                record["error"] = str(exc)
            record.update(applied_at_s=round(done - gate_s, 4), took_s=round(done - started, 4))
            if len(target.records) < MAX_CHANGES_KEPT:
                target.records.append(record)
