"""Fault injection as a sweep option: kill, restart, pause or cut a node's link at a given time.

A spec's top-level ``faults:`` list applies to every point::

    faults:
      - {action: kill, target: worker-1, at_s: 5}                   # SIGKILL the container / process
      - {action: restart, target: worker-1, at_s: 8}                # start it again: it rejoins
      - {action: pause, target: worker-2, at_s: 4, duration_s: 3}   # docker pause / SIGSTOP, then resume
      - {action: disconnect, target: worker-2, at_s: 4, duration_s: 3}  # docker network disconnect (docker only)

`at_s` counts from the first training step (the coordinator writes `coordinator.training` into its
metrics folder then). Targets are ``coordinator`` or ``worker-N`` (the Nth worker, 1-based). The
injector runs on a thread, records what it did and when (`events`), and never raises into the run.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol

from harness.errors import SpecError

ACTIONS = ("kill", "restart", "pause", "disconnect")
NEEDS_DURATION = ("pause", "disconnect")
MARKER = "coordinator.training"


@dataclass(frozen=True)
class Fault:
    """One fault: `action` on `target` at `at_s` seconds after training starts, for `duration_s`."""

    action: str
    target: str
    at_s: float
    duration_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"action": self.action, "target": self.target, "at_s": self.at_s, "duration_s": self.duration_s}


def parse_faults(value: Any, source: str, num_workers: int | None = None) -> list[Fault]:
    """Validate a spec's ``faults`` list. Raises SpecError naming the file, the entry and what is allowed."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise SpecError(f"{source}: faults: expected a list of {{action, target, at_s[, duration_s]}}")
    faults = []
    for i, entry in enumerate(value):
        path = f"{source}: faults[{i}]"
        if not isinstance(entry, dict):
            raise SpecError(f"{path}: expected a mapping with action, target, at_s")
        unknown = sorted(set(entry) - {"action", "target", "at_s", "duration_s"})
        if unknown:
            raise SpecError(f"{path}.{unknown[0]}: unknown key; allowed: action, target, at_s, duration_s")
        action, target = entry.get("action"), entry.get("target")
        if action not in ACTIONS:
            raise SpecError(f"{path}.action: {action!r}; allowed: {', '.join(ACTIONS)}")
        if not isinstance(target, str) or not (target == "coordinator" or _worker_index(target)):
            raise SpecError(f"{path}.target: {target!r}; allowed: coordinator or worker-N (N >= 1)")
        if num_workers is not None and target != "coordinator" and _worker_index(target) > num_workers:
            raise SpecError(f"{path}.target: {target} but the point has {num_workers} workers")
        at_s, duration_s = entry.get("at_s"), entry.get("duration_s", 0.0)
        for name, number in (("at_s", at_s), ("duration_s", duration_s)):
            if isinstance(number, bool) or not isinstance(number, (int, float)) or not 0 <= number <= 86400:
                raise SpecError(f"{path}.{name}: {number!r}; allowed: seconds, 0..86400")
        if action in NEEDS_DURATION and duration_s <= 0:
            raise SpecError(f"{path}.duration_s: {action} needs a duration > 0 s")
        faults.append(Fault(action, target, float(at_s), float(duration_s)))
    return faults


def _worker_index(target: str) -> int:
    if target.startswith("worker-") and target[7:].isdigit() and int(target[7:]) >= 1:
        return int(target[7:])
    return 0


class Controller(Protocol):
    """What a backend offers the injector, by target name (``coordinator``, ``worker-N``)."""

    def kill(self, target: str) -> None: ...
    def restart(self, target: str) -> None: ...
    def pause(self, target: str) -> None: ...
    def resume(self, target: str) -> None: ...
    def disconnect(self, target: str) -> None: ...
    def reconnect(self, target: str) -> None: ...
    def node_id(self, target: str) -> str: ...


class FaultInjector:
    """Runs `faults` against a `Controller` on a daemon thread, timed from the training marker."""

    def __init__(self, faults: list[Fault], controller: Controller, nodes_dir: Path, wait_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.faults = sorted(faults, key=lambda f: f.at_s)
        self.controller = controller
        self.marker = Path(nodes_dir) / MARKER
        self.wait_s = wait_s
        self.events: list[dict[str, Any]] = []
        # every target a fault hit: its own exit (killed, or gave up after a cut) is the fault's effect,
        # not a failure of the run; the coordinator's outcome decides (harness.cluster.base.judge)
        self.affected: set[str] = set()
        self.affected_node_ids: set[str] = set()  # the same, as the node ids in their metrics files
        self._clock = clock
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="faults", daemon=True)

    def start(self) -> "FaultInjector":
        if self.faults:
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    def _record(self, t_s: float, action: str, target: str, error: str | None = None) -> None:
        self.events.append({"t_s": round(t_s, 3), "action": action, "target": target,
                            "ok": error is None, "error": error})

    def _run(self) -> None:
        deadline = self._clock() + self.wait_s
        while not self.marker.exists():
            if self._stop.wait(0.05) or self._clock() > deadline:
                self._record(0.0, "wait", "coordinator", f"training never started ({self.marker} absent)")
                return
        t0 = self._clock()
        plan: list[tuple[float, str, Fault]] = []
        for fault in self.faults:
            plan.append((fault.at_s, fault.action, fault))
            if fault.action == "pause":
                plan.append((fault.at_s + fault.duration_s, "resume", fault))
            elif fault.action == "disconnect":
                plan.append((fault.at_s + fault.duration_s, "reconnect", fault))
        plan.sort(key=lambda item: item[0])
        for at_s, action, fault in plan:
            if self._stop.wait(max(0.0, t0 + at_s - self._clock())):
                return
            try:
                getattr(self.controller, action)(fault.target)
            except Exception as exc:  # a failed injection is recorded, never fatal to the run
                self._record(self._clock() - t0, action, fault.target, f"{type(exc).__name__}: {exc}")
                continue
            self.affected.add(fault.target)
            try:
                self.affected_node_ids.add(self.controller.node_id(fault.target))
            except Exception:  # the node id only serves judging; a target without one is judged by name
                pass
            self._record(self._clock() - t0, action, fault.target)
