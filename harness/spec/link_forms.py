"""The YAML forms of changing profiles and of links by pair: schema-only models for the JSON Schema of
a sweep spec (`harness.spec.schema`), never built from a spec (the validators are
`harness.spec.timeline` and `harness.spec.pairs`), and `form_label`, their part of a point's label."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from harness.spec.links import PROFILE_KEYS, LinkProfile

_UNIT = Annotated[str, Field(description="a value with its unit: 0s, 20s, 100mbit, 20ms, 1%")]


class ScheduleStep(BaseModel):
    """One step of a schedule: ``at`` (time since training started) and what changes then."""

    model_config = ConfigDict(extra="forbid")
    at: _UNIT
    rate: _UNIT | None = None
    delay: _UNIT | None = None
    jitter: _UNIT | None = None
    loss: float | str | None = None


class ScheduledProfile(LinkProfile):
    """A profile that changes on a schedule: the other profile keys beside ``schedule``."""

    yaml_keys = (*PROFILE_KEYS, "schedule", "allow_partial")
    schedule: Annotated[list[ScheduleStep], Field(min_length=1)]
    allow_partial: bool = False


class TraceProfile(LinkProfile):
    """A profile whose rate follows a Mahimahi trace (a path from the repository's root)."""

    yaml_keys = (*PROFILE_KEYS, "trace", "window", "loop", "allow_partial")
    trace: str
    window: _UNIT = "100ms"
    loop: bool = True
    allow_partial: bool = False


_PROFILE = str | LinkProfile | ScheduledProfile | TraceProfile | None


class PairForm(BaseModel):
    """One ``pairs`` entry: ``between`` two node names and a ``profile`` (or profile keys in its place)."""

    model_config = ConfigDict(extra="allow")
    between: Annotated[list[Annotated[str, Field(pattern=r"^(coordinator|worker|worker-[1-9][0-9]*)$")]],
                       Field(min_length=2, max_length=2)]
    profile: _PROFILE = None


class TopologyForm(BaseModel):
    """A ``link`` by pair of nodes: ``pairs``, or ``regions`` with ``lan``/``wan``, and ``default``."""

    model_config = ConfigDict(extra="forbid")
    pairs: list[PairForm] = []
    regions: dict[str, list[str]] = {}
    lan: _PROFILE = None
    wan: _PROFILE = None
    default: _PROFILE = None
    allow_partial: bool = False


def form_label(key: str, leaf: Any) -> str | None:
    """What a point's params show for one key of a ``link`` mapping in these forms, e.g.
    ``schedule(0s:200mbit 15s:100mbit)``, ``trace=walk-1.trace``, ``pairs(2)``; None for any other key."""
    if key == "schedule" and isinstance(leaf, list):
        steps = " ".join(f"{s.get('at')}:" + "/".join(str(v) for k, v in s.items() if k != "at")
                         for s in leaf if isinstance(s, dict))
        return f"schedule({steps})"
    if key == "trace" and isinstance(leaf, str):
        return f"trace={Path(leaf).name}"
    if isinstance(leaf, list):
        return f"{key}({len(leaf)})"
    return None
