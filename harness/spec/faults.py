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

from dataclasses import dataclass
from typing import Any

from harness.errors import SpecError

ACTIONS = ("kill", "restart", "pause", "disconnect")


NEEDS_DURATION = ("pause", "disconnect")


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
