"""Link profiles that change while training: a schedule of steps, or a Mahimahi trace.

In a spec, where a profile goes (``link``, ``link_presets``, a pair's ``profile``)::

    {schedule: [{at: 0s, rate: 200mbit}, {at: 20s, rate: 100mbit}]}
    {schedule: [{at: 0s, rate: 100mbit, delay: 10ms}, {at: 15s, delay: 50ms, loss: 1%}], qdisc: tbf}
    {trace: experiments/traces/walk-1.trace, window: 100ms}            # loops, as mm-link does
    {trace: experiments/traces/drive-2.trace, window: 250ms, loop: false, delay: 20ms}

A schedule's steps are at times since training started (the start gate's opening), the first at 0 s,
each later one strictly after the one before; a step sets any of `STEP_KEYS`, and what it does not set
carries over from the step before. The other keys beside ``schedule`` (or ``trace``) are the profile's
fixed part (`harness.spec.links.PROFILE_KEYS`). A trace gives the rate (`harness.links.trace`), so its
profile sets no ``rate`` of its own. Every step's profile is validated when the spec loads, as any
profile is; a bad step names its index and key (``schedule[2].rate: ...``).

The profile in force at 0 s is a `TimedProfile`: a `LinkProfile` (so the tc tree is built from it as
from any profile) with the `timeline` of later changes. `harness.links.schedule` builds the commands of
each change, `harness.run.link_timeline` applies them on time and records when each took effect.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator, Mapping

from harness import REPO_ROOT
from harness.errors import SpecError
from harness.links.trace import DEFAULT_WINDOW_MS, TraceError, period_ms, rate_steps, read_trace
from harness.spec.base import fail, shown, unit
from harness.spec.links import NETEM_OFF, PROFILE_KEYS, LinkProfile
from wiiide.units import parse_time_ms

STEP_KEYS = {"rate": "rate_bps", "delay": "delay_ms", "jitter": "jitter_ms", "loss": "loss_pct"}
NETEM_FIELDS = ("delay_ms", "jitter_ms", "loss_pct")
TIMELINE_KEYS = ("schedule", "trace", "window", "loop")
MAX_STEPS = 10_000
MAX_AT_S = 86_400.0


class TimedProfile(LinkProfile):
    """A profile that changes: the fields at 0 s, and `timeline`, the changes after 0 s as ``(at_s,
    {field: value})`` in time order (field names as `LinkProfile`'s). `period_s`: the timeline repeats
    every period (a trace, as mm-link repeats it; None: the last step holds). `source`: ``schedule``
    or the trace's path, for the report."""

    timeline: tuple[tuple[float, dict[str, Any]], ...] = ()
    period_s: float | None = None
    source: str = "schedule"

    @property
    def needs_netem(self) -> bool:
        """Whether a netem qdisc is needed: a delay or a loss at 0 s or in any later step (the tree is
        built once, with netem under the rate class, and each step changes it)."""
        return super().needs_netem or any(changes.get(f) for _, changes in self.timeline for f in NETEM_FIELDS)

    def changed_fields(self) -> set[str]:
        """The fields some later step sets."""
        return {f for _, changes in self.timeline for f in changes}

    def without_netem(self) -> "LinkProfile | None":
        """The rate part alone, its timeline kept only for the rate (None without a rate)."""
        if self.rate_bps is None:
            return None
        kept = tuple((at, {"rate_bps": c["rate_bps"]}) for at, c in self.timeline if "rate_bps" in c)
        return self.replace(**NETEM_OFF, timeline=kept)

    def without_changes_of(self, fields: set[str]) -> "TimedProfile":
        """A copy whose later steps no longer set `fields` (steps left empty are dropped)."""
        kept = [(at, {f: v for f, v in c.items() if f not in fields}) for at, c in self.timeline]
        return self.replace(timeline=tuple((at, c) for at, c in kept if c))

    def to_dict(self) -> dict[str, Any]:
        """The fields at 0 s (as `LinkProfile.to_dict`) and ``timeline``: its source, period, number of
        changes and, for up to 50 changes, the changes themselves (``[at_s, {field: value}]``)."""
        out = LinkProfile(**{k: v for k, v in self.model_dump().items()
                             if k not in ("timeline", "period_s", "source")}).to_dict()
        out["timeline"] = {"source": self.source, "period_s": self.period_s, "changes": len(self.timeline),
                           "steps": [[at, dict(c)] for at, c in self.timeline] if len(self.timeline) <= 50 else None}
        return out

    def iter_changes(self) -> Iterator[tuple[float, dict[str, Any]]]:
        """Every change after 0 s as ``(at_s, {field: value})``, in time order; without end when the
        timeline repeats (`period_s`): then the fields at 0 s come back at each period's start."""
        yield from self.timeline
        if self.period_s is None or not self.timeline:
            return
        start = {f: getattr(self, f) for f in self.changed_fields()}
        repeat = 1
        while True:
            base = repeat * self.period_s
            yield base, dict(start)
            for at, changes in self.timeline:
                yield base + at, changes
            repeat += 1


def is_timed(value: Any) -> bool:
    """Whether a profile mapping of a spec is a schedule or a trace (it has ``schedule`` or ``trace``)."""
    return isinstance(value, Mapping) and ("schedule" in value or "trace" in value)


def _at_s(value: Any, where: str) -> float:
    try:
        at_ms = unit(parse_time_ms, value)
    except ValueError as exc:
        raise fail(str(exc), where) from None
    if not 0 <= at_ms / 1000 <= MAX_AT_S:
        raise fail(f"{shown(value)}; allowed: 0s..{MAX_AT_S:g}s", where)
    return round(at_ms / 1000, 6)


def _fixed(data: Mapping[str, Any]) -> dict[str, Any]:
    """The profile keys beside ``schedule``/``trace``; any other key is refused."""
    for key in data:
        if key not in PROFILE_KEYS and key not in TIMELINE_KEYS:
            raise fail(f"unknown key; allowed: {', '.join((*TIMELINE_KEYS, *PROFILE_KEYS))}", str(key))
    return {k: v for k, v in data.items() if k in PROFILE_KEYS}


def _step_profile(fixed: dict[str, Any], where: tuple[str | int, ...], name: str) -> LinkProfile:
    try:
        return LinkProfile.from_mapping(fixed, name)
    except SpecError as exc:
        message = str(exc).removeprefix(f"link profile {name!r}: ")
        key, _, rest = message.partition(": ")
        if key in PROFILE_KEYS:
            raise fail(rest, *where, key) from None
        raise fail(message, *where) from None


def parse_schedule(data: Mapping[str, Any], name: str = "inline") -> TimedProfile:
    """A ``{schedule: [...], <profile keys>}`` mapping (see the module doc) -> `TimedProfile`.

    Raises:
        PydanticCustomError (`fail`): with the path below the value (``schedule[1].at``) and what is
        allowed: no steps, a first step not at 0 s, steps out of order, an unknown step key, a step
        whose profile is not valid (as `LinkProfile`), or more than `MAX_STEPS` steps.
    """
    fixed = _fixed(data)
    if "trace" in data:
        raise fail("give a schedule or a trace, not both", "trace")
    steps = data["schedule"]
    if not isinstance(steps, list) or not steps:
        raise fail(f"{shown(steps)}; allowed: a non-empty list of steps like {{at: 0s, rate: 100mbit}}", "schedule")
    if len(steps) > MAX_STEPS:
        raise fail(f"{len(steps)} steps; allowed: at most {MAX_STEPS}", "schedule")
    timeline: list[tuple[float, dict[str, Any]]] = []
    previous_at = -1.0
    current = dict(fixed)
    profiles: list[LinkProfile] = []
    for i, step in enumerate(steps):
        if not isinstance(step, Mapping) or "at" not in step:
            raise fail(f"{shown(step)}; allowed: a mapping with at and some of {', '.join(STEP_KEYS)}", "schedule", i)
        for key in step:
            if key != "at" and key not in STEP_KEYS:
                raise fail(f"unknown key; allowed: at, {', '.join(STEP_KEYS)}", "schedule", i, str(key))
        at = _at_s(step["at"], "at")
        if i == 0 and at != 0:
            raise fail(f"{shown(step['at'])}; the first step is at 0s (when training starts)", "schedule", 0, "at")
        if at <= previous_at:
            raise fail(f"{shown(step['at'])} is not after the step before ({previous_at:g} s)", "schedule", i, "at")
        if i > 0 and len(step) == 1:
            raise fail("a step after the first changes something: set one of " + ", ".join(STEP_KEYS), "schedule", i)
        current.update({k: v for k, v in step.items() if k != "at"})
        profile = _step_profile(current, ("schedule", i), name)
        if i > 0 and "rate" in step and profiles[0].rate_bps is None:
            raise fail("a rate that changes is set from the first step (the rate class is made then)",
                       "schedule", i, "rate")
        changes = {STEP_KEYS[k]: getattr(profile, STEP_KEYS[k]) for k in step if k != "at"}
        if i > 0:
            timeline.append((at, changes))
        profiles.append(profile)
        previous_at = at
    return TimedProfile(**profiles[0].model_dump(), timeline=tuple(timeline), source="schedule").model_copy(
        update={"name": str(name)})


def resolve_trace_path(value: Any) -> Path:
    """A trace path as a spec writes it: absolute, or relative to the repository's root
    (``experiments/traces/walk-1.trace``). Raises ValueError for a value that is not a string."""
    if not isinstance(value, str) or not value:
        raise ValueError(f"{shown(value)}; allowed: a path to a Mahimahi trace, e.g. experiments/traces/walk-1.trace")
    path = Path(value)
    return path if path.is_absolute() else REPO_ROOT / path


def parse_trace_profile(data: Mapping[str, Any], name: str = "inline") -> TimedProfile:
    """A ``{trace: PATH, window: 100ms, loop: true, <profile keys but rate>}`` mapping -> `TimedProfile`
    whose rate follows the trace (`harness.links.trace.rate_steps`), repeating every trace period
    unless ``loop: false`` (then its last window's rate holds).

    Raises:
        PydanticCustomError (`fail`): a missing or bad trace (empty, non-monotonic, negative, huge, not
        numbers: the line is named), a window outside 10ms..60s, a ``rate`` beside the trace, or a
        profile key that is not valid.
    """
    fixed = _fixed(data)
    if "rate" in fixed:
        raise fail("a trace sets the rate; leave rate out", "rate")
    try:
        path = resolve_trace_path(data["trace"])
        opportunities = read_trace(path)
    except (ValueError, TraceError) as exc:
        raise fail(str(exc), "trace") from None
    window_ms = _at_s(data.get("window", f"{DEFAULT_WINDOW_MS:g}ms"), "window") * 1000
    if not 10 <= window_ms <= 60_000:
        raise fail(f"{window_ms:g} ms; allowed: 10ms..60s", "window")
    loop = data.get("loop", True)
    if not isinstance(loop, bool):
        raise fail(f"{shown(loop)}; allowed: true or false", "loop")
    try:
        steps = rate_steps(opportunities, window_ms)
    except TraceError as exc:
        raise fail(str(exc), "trace") from None
    first = _step_profile({**fixed, "rate": f"{steps[0][1]}bit"}, (), name)
    source = str(data["trace"])
    timeline = tuple((at, {"rate_bps": rate}) for at, rate in steps[1:])
    profile = TimedProfile(**first.model_dump(), timeline=timeline, source=source,
                           period_s=period_ms(opportunities) / 1000 if loop else None)
    return profile.model_copy(update={"name": str(name)})


def parse_timed(data: Mapping[str, Any], name: str = "inline") -> TimedProfile:
    """A schedule or a trace mapping (`is_timed`) -> `TimedProfile`. Raises as `parse_schedule` /
    `parse_trace_profile`."""
    return parse_schedule(data, name) if "schedule" in data else parse_trace_profile(data, name)
