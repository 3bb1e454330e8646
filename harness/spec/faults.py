"""Fault injection as a sweep option: kill, restart, pause or cut a node's link at a given time.

A spec's top-level ``faults:`` list applies to every point::

    faults:
      - {action: kill, target: worker-1, at_s: 5}                   # SIGKILL the container / process
      - {action: restart, target: worker-1, at_s: 8}                # start it again: it rejoins
      - {action: pause, target: worker-2, at_s: 4, duration_s: 3}   # docker pause / SIGSTOP, then resume
      - {action: disconnect, target: worker-2, at_s: 4, duration_s: 3}  # docker network disconnect (docker only)

`at_s` counts from the first training step (the coordinator writes `coordinator.training` into its
metrics folder then). Targets are ``coordinator`` or ``worker-N`` (the Nth worker, 1-based). The
injector (harness.run.faults) runs on a thread, records what it did and when, and never raises into the run.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, StrictFloat, TypeAdapter, model_validator

from harness.errors import SpecError
from harness.spec.base import SpecModel, fail, shown, validate

ACTIONS = ("kill", "restart", "pause", "disconnect")
NEEDS_DURATION = ("pause", "disconnect")
MAX_TIME_S = 86_400.0
MAX_WORKER_DIGITS = 6  # worker-1 .. worker-999999; a longer number is refused before int() sees it
TARGET_PATTERN = rf"^(coordinator|worker-[1-9][0-9]{{0,{MAX_WORKER_DIGITS - 1}}})$"


def _target(target: str) -> str:
    if not re.match(TARGET_PATTERN, target):
        raise ValueError(f"{shown(target)}; allowed: coordinator or worker-N (1 <= N < 10**{MAX_WORKER_DIGITS})")
    return target


def _seconds(value: float) -> float:
    if not 0 <= value <= MAX_TIME_S:
        raise ValueError(f"{value!r}; allowed: seconds, 0..{MAX_TIME_S:g}")
    return value


Seconds = Annotated[StrictFloat, AfterValidator(_seconds),
                    Field(json_schema_extra={"minimum": 0, "maximum": MAX_TIME_S})]


class Fault(SpecModel):
    """One fault: `action` on `target` at `at_s` seconds after training starts, for `duration_s` seconds
    (pause and disconnect only; both 0..86,400 s).

    Raises:
        SpecError: an unknown action or key, a target other than coordinator / worker-N, a time out of
        range, or a pause / disconnect without a duration.
    """

    action: Literal[ACTIONS]  # type: ignore[valid-type]
    target: Annotated[str, AfterValidator(_target), Field(json_schema_extra={"pattern": TARGET_PATTERN})]
    at_s: Seconds
    duration_s: Seconds = 0.0

    @model_validator(mode="after")
    def _duration(self) -> "Fault":
        if self.action in NEEDS_DURATION and self.duration_s <= 0:
            raise fail(f"{self.action} needs a duration > 0 s", "duration_s")
        return self

    @property
    def worker_index(self) -> int | None:
        """N of a ``worker-N`` target (1-based); None for the coordinator."""
        return None if self.target == "coordinator" else int(self.target.removeprefix("worker-"))

    def to_dict(self) -> dict[str, Any]:
        """``{"action", "target", "at_s", "duration_s"}``, as reports record it."""
        return self.model_dump()


FAULTS = TypeAdapter(list[Fault])


def parse_faults(value: Any, source: str, num_workers: int | None = None) -> list[Fault]:
    """Validate a spec's ``faults`` list (None: no faults). `num_workers`, when given, is the fewest
    workers of any point: a ``worker-N`` target beyond it is refused.

    Raises:
        SpecError: ``<source>: faults[i].<key>: ...`` naming the entry and what is allowed.
    """
    if value is None:
        return []
    faults = validate(FAULTS, value, source, "faults")
    check_targets(faults, source, num_workers)
    return faults


def check_targets(faults: list[Fault], source: str, num_workers: int | None) -> None:
    """Raise SpecError when a fault targets ``worker-N`` with N > `num_workers` (None: no check)."""
    for i, fault in enumerate(faults):
        if num_workers is not None and (fault.worker_index or 0) > num_workers:
            raise SpecError(f"{source}: faults[{i}].target: {fault.target} but the point has {num_workers} workers")
