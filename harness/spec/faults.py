"""Fault injection as a sweep option: kill, restart, pause or cut a node's link at a given time.

A spec's top-level ``faults:`` list applies to every point::

    faults:
      - {action: kill, target: worker-1, at_s: 5}                   # SIGKILL the container / process
      - {action: restart, target: worker-1, at_s: 8}                # start it again: it rejoins
      - {action: pause, target: worker-2, at_s: 4, duration_s: 3}   # docker pause / SIGSTOP, then resume
      - {action: disconnect, target: worker-2, at_s: 4, duration_s: 3}  # docker network disconnect (docker only)

Or a seeded random schedule (`RandomSchedule`), expanded into such a list when the spec is read, so
the report records every fault it drew and the same seed draws the same faults::

    faults:
      random: {seed: 7, targets: [coordinator, worker-1, worker-2], start_s: 20, until_s: 560,
               every_s: [20, 40], actions: [kill, pause, disconnect], down_s: [3, 8]}

A drawn ``kill`` comes with a ``restart`` of the same target `down_s` later; ``pause`` and
``disconnect`` last `down_s`; a target is not hit again before it is back.

`at_s` counts from the first training step (the coordinator writes `coordinator.training` into its
metrics folder then). Targets are ``coordinator`` or ``worker-N`` (the Nth worker, 1-based). The
injector (harness.run.faults) runs on a thread, records what it did and when, and never raises into the run.
"""

from __future__ import annotations

import random
import re
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BeforeValidator,
    Field,
    StrictFloat,
    StrictInt,
    TypeAdapter,
    ValidationError,
    model_validator,
)

from harness.errors import SpecError
from harness.spec.base import SpecModel, fail, shown, spec_error, validate

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


RANDOM_ACTIONS = ("kill", "pause", "disconnect")  # a drawn kill brings its own restart
MAX_RANDOM_FAULTS = 10_000


def _interval(value: list[float]) -> list[float]:
    if len(value) != 2 or not 0 < value[0] <= value[1]:
        raise ValueError(f"{shown(value)}; allowed: [min_s, max_s] with 0 < min_s <= max_s")
    return value


Interval = Annotated[list[Seconds], AfterValidator(_interval)]


class RandomSchedule(SpecModel):
    """A seeded random fault schedule: from `start_s` to `until_s` seconds after training starts, a
    fault every `every_s` = [min, max] seconds (uniform), each an action drawn from `actions` on a
    target drawn from `targets` that is not down at that instant; a ``kill`` is followed by a
    ``restart`` `down_s` = [min, max] seconds later (uniform), ``pause`` and ``disconnect`` last as long.
    Python's `random.Random(seed)`: the same seed draws the same schedule on every machine.

    Raises:
        SpecError: an unknown key, an action other than kill / pause / disconnect, a bad target or
            interval, or a schedule of more than MAX_RANDOM_FAULTS faults.
    """

    seed: StrictInt
    targets: Annotated[list[Annotated[str, AfterValidator(_target)]], Field(min_length=1)]
    until_s: Seconds
    start_s: Seconds = 0.0
    every_s: Interval = [20.0, 40.0]
    down_s: Interval = [3.0, 8.0]
    actions: Annotated[list[Literal[RANDOM_ACTIONS]], Field(min_length=1)] = list(RANDOM_ACTIONS)  # type: ignore[valid-type]

    @model_validator(mode="after")
    def _size(self) -> "RandomSchedule":
        if self.until_s < self.start_s:
            raise fail(f"{self.until_s:g} is before start_s={self.start_s:g}", "until_s")
        if (self.until_s - self.start_s) / self.every_s[0] > MAX_RANDOM_FAULTS:
            raise fail(f"more than {MAX_RANDOM_FAULTS} faults between start_s and until_s; allowed: fewer",
                       "every_s")
        return self

    def draw(self) -> list[dict[str, Any]]:
        """The schedule as `Fault` dicts (times rounded to 0.1 s), in time order."""
        rng = random.Random(self.seed)
        back_at: dict[str, float] = {}
        out: list[dict[str, Any]] = []
        t = self.start_s
        while t <= self.until_s:
            free = [target for target in self.targets if back_at.get(target, 0.0) <= t]
            if free:
                action, target = rng.choice(self.actions), rng.choice(free)
                down = round(rng.uniform(*self.down_s), 1)
                at = round(t, 1)
                if action == "kill":
                    out += [{"action": "kill", "target": target, "at_s": at},
                            {"action": "restart", "target": target, "at_s": round(at + down, 1)}]
                else:
                    out.append({"action": action, "target": target, "at_s": at, "duration_s": down})
                back_at[target] = at + down + 1.0  # a second to come back before it is hit again
            t += rng.uniform(*self.every_s)
        return out


def expand_random(value: Any) -> Any:
    """``{"random": {...}}`` -> the list of fault dicts `RandomSchedule.draw` gives; anything else as
    it is (a list is validated as faults afterwards). For a pydantic validator of a spec's ``faults``.

    Raises:
        PydanticCustomError: the schedule's first problem, at its path below ``random``.
    """
    if isinstance(value, dict) and set(value) == {"random"}:
        try:
            schedule = RandomSchedule.model_validate(value["random"], context={"yaml": True})
        except ValidationError as exc:
            raise fail(spec_error(exc).args[0], "random") from None  # its message starts with the path below
        return schedule.draw()
    return value


class RandomFaults(SpecModel):
    """Schema only: ``faults: {random: {...}}``, a `RandomSchedule` drawn into a list of faults."""

    random: RandomSchedule


FAULTS = TypeAdapter(Annotated[list[Fault], BeforeValidator(expand_random, json_schema_input_type=list[Fault] | RandomFaults)])


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
