"""Sweep specs: a YAML file under ``experiments/`` that names a base config and a grid of axes.

Format (the JSON Schema generated from `SweepSpec` is shipped as harness/spec/sweep-spec.schema.json)::

    name: quick                       # used in the results folder name
    description: one line for people
    repeats: 1                        # runs per point
    base:                             # RunConfig fields (wiiide.config), applied to every point
      dataset: digits
      duration_s: 8
      num_workers: 2
    axes:                             # the grid: every combination of these values is a point
      compression: [none, adaptive]
      buffer_bytes: [1MiB, 8MiB]      # alias: sets sndbuf_bytes and rcvbuf_bytes together
      link: [lan-1g, rate-100m]       # per-container settings (harness.spec.cluster): link
      cpus: [0, {worker-2: 0.25}]     # profiles (presets in experiments/links.yaml), cpus, mem_limit
      engine:                         # a mapping naming the axis's own field is a variant: one value
        - wiiide                      # that sets several fields; `label` names it in params and tables
        - {label: ddp-fp16, engine: ddp, ddp_comm_hook: fp16}
    reference:                        # optional: the seeds' figures, copied into the report
      ...
    timeout_s: 300                    # optional, per repeat
    link_presets: {...}               # optional, beside experiments/links.yaml's (harness.spec.links)
    faults: [...]                     # optional (harness.spec.faults), or {random: {...}}: a seeded schedule
    host_sysctls: {...}               # optional (harness.spec.sysctls)

Every point's config is built and validated when the spec loads, so a bad value stops the sweep
before any container starts, with the file, the field path and what is allowed (`SpecError`).
"""

from __future__ import annotations

import fnmatch
import itertools
from pathlib import Path
from typing import Annotated, Any, Mapping

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    InstanceOf,
    StrictFloat,
    StrictInt,
    model_validator,
)
from pydantic.json_schema import SkipJsonSchema
from pydantic_core import PydanticCustomError

from harness.errors import SpecError
from harness.spec.base import SpecModel, fail, shown, validate
from harness.spec.cluster import (
    CLUSTER_KEYS,
    ClusterSettings,
    CpusValue,
    LinkValue,
    MemValue,
    load_presets,
    param_label,
    parse_cluster,
)
from harness.spec.faults import Fault, RandomFaults, check_targets, expand_random
from harness.spec.link_forms import ScheduledProfile, TraceProfile
from harness.spec.links import LinkProfile
from harness.spec.timeline import is_timed, parse_timed
from harness.spec.sysctls import HostSysctls
from harness.spec.yaml_file import load_yaml_file
from wiiide.config import RunConfig
from wiiide.errors import ConfigError

# Axis names that set several config fields at once.
ALIASES: dict[str, tuple[str, ...]] = {
    "buffer_bytes": ("sndbuf_bytes", "rcvbuf_bytes"),
    "workers": ("num_workers",),
}
TOP_LEVEL_KEYS = ("name", "description", "repeats", "base", "axes", "reference", "timeout_s", "link_presets",
                  "faults", "host_sysctls")
NAME_PATTERN = r"^[A-Za-z0-9._-]+$"
MAX_REPEATS = 1000


def known_keys() -> tuple[str, ...]:
    """The keys `base` and `axes` take: RunConfig's fields, the `ALIASES` and the `CLUSTER_KEYS`, sorted."""
    return tuple(sorted(set(RunConfig.field_names()) | set(ALIASES) | set(CLUSTER_KEYS)))


class Point(BaseModel):
    """One grid point: its `index` (0-based, in grid order), the swept values (`params`: axis name ->
    the value or its label), the full validated `config` and the per-container `cluster` settings
    (link, cpus, mem_limit: not node knobs, harness.spec.cluster)."""

    model_config = ConfigDict(frozen=True)

    index: int
    params: dict[str, Any]
    config: InstanceOf[RunConfig]
    cluster: ClusterSettings = Field(default_factory=ClusterSettings)


# ------------------------------------------------------------------------- field checks of the file

def _or_empty(empty: Any) -> BeforeValidator:
    """``base:`` with nothing after it is YAML's null: read it as empty."""
    return BeforeValidator(lambda v: empty() if v is None else v)


def _name(name: str) -> str:
    if not name or not all(c.isalnum() or c in "-_." for c in name):
        raise ValueError(f"{shown(name)} must be a non-empty string of letters, digits, '-', '_' or '.'")
    return name


def _repeats(repeats: int) -> int:
    if not 1 <= repeats <= MAX_REPEATS:
        raise ValueError(f"{repeats!r} must be an integer 1..{MAX_REPEATS}")
    return repeats


def _positive_s(seconds: float | None) -> float | None:
    if seconds is not None and seconds <= 0:
        raise ValueError(f"{seconds!r} must be a positive number of seconds")
    return seconds


def _axes(axes: dict[str, Any]) -> dict[str, list[Any]]:
    for key, values in axes.items():
        if not isinstance(values, list) or not values:
            raise fail("expected a non-empty list of values", key)
    return axes


def _presets(presets: dict[str, Any]) -> dict[str, Any]:
    for name, profile in presets.items():
        try:
            if is_timed(profile):  # a schedule or a trace (harness.spec.timeline)
                parse_timed(profile, name)
            else:
                LinkProfile.from_mapping(profile, name)
        except PydanticCustomError as exc:
            raise fail(exc.message(), name, *(exc.context or {}).get("path", ())) from None
        except SpecError as exc:
            raise fail(str(exc), name) from None
    return presets


class SpecBase(BaseModel):
    """Schema only (SweepSpec checks it): `base`: RunConfig fields (wiiide.config) for every point, the aliases ``buffer_bytes`` (sndbuf_bytes
    and rcvbuf_bytes) and ``workers`` (num_workers), and the per-container link, cpus and mem_limit."""

    model_config = ConfigDict(extra="allow", json_schema_extra=lambda s: s.update(
        propertyNames={"enum": list(known_keys())}, additionalProperties=True))
    link: LinkValue = None
    cpus: CpusValue = None
    mem_limit: MemValue = None


class SpecAxes(BaseModel):
    """Schema only (SweepSpec checks it): `axes`: the grid, by the keys `base` takes; each a non-empty list of values. A mapping that names
    the axis's own key is a variant setting several fields (``label`` names it)."""

    model_config = ConfigDict(extra="allow", json_schema_extra=lambda s: s.update(
        propertyNames={"enum": list(known_keys())}, additionalProperties={"type": "array", "minItems": 1}))
    link: Annotated[list[LinkValue], Field(min_length=1)] = None  # type: ignore[assignment]
    cpus: Annotated[list[CpusValue], Field(min_length=1)] = None  # type: ignore[assignment]
    mem_limit: Annotated[list[MemValue], Field(min_length=1)] = None  # type: ignore[assignment]


class SweepSpec(SpecModel):
    """A validated sweep spec and its grid of `points`; every key of the YAML file is a field.

    name: letters, digits, '-', '_', '.' (default: the file's stem). repeats: runs per point,
    1..1000. base / axes: config fields as written (see the module doc). timeout_s: per repeat, in
    seconds (None: derived from duration and connect timeout). link_presets: the spec's own, as
    written, beside experiments/links.yaml's. faults: injected in every run. host_sysctls: key ->
    bytes, set for the sweep. `source` is the file it came from; `points` and `source` are not keys
    of the file. Build it with `build_spec` / `load_spec` (they expand the grid).
    """

    model_config = ConfigDict(frozen=False, json_schema_extra={"title": "WIIIIIDE sweep spec"})
    yaml_keys = TOP_LEVEL_KEYS

    name: Annotated[str, AfterValidator(_name), Field(validate_default=True, description=(
        "used in the results folder name (default: the file's stem)"), json_schema_extra={"pattern": NAME_PATTERN})] = ""
    description: str = ""
    repeats: Annotated[StrictInt, AfterValidator(_repeats),
                       Field(json_schema_extra={"minimum": 1, "maximum": MAX_REPEATS})] = 1
    base: Annotated[dict[str, Any], _or_empty(dict), BeforeValidator(lambda v: v, json_schema_input_type=SpecBase)] = {}
    axes: Annotated[dict[str, Any], _or_empty(dict), AfterValidator(_axes),
                    BeforeValidator(lambda v: v, json_schema_input_type=SpecAxes)] = {}
    reference: Annotated[dict[str, Any], _or_empty(dict)] = {}
    timeout_s: Annotated[StrictFloat | None, AfterValidator(_positive_s),
                         Field(json_schema_extra={"exclusiveMinimum": 0})] = None
    link_presets: Annotated[dict[str, dict[str, Any]], _or_empty(dict), AfterValidator(_presets),
                            BeforeValidator(lambda v: v, json_schema_input_type=dict[
                                str, LinkProfile | ScheduledProfile | TraceProfile])] = {}
    faults: Annotated[list[Fault], BeforeValidator(expand_random, json_schema_input_type=list[Fault] | RandomFaults),
                      _or_empty(list)] = []
    host_sysctls: Annotated[HostSysctls, _or_empty(dict)] = {}
    source: SkipJsonSchema[str] = "<dict>"
    points: SkipJsonSchema[list[Point]] = []

    @model_validator(mode="after")
    def _configs(self) -> "SweepSpec":
        """Known keys in base and axes; RunConfig accepts base, and base with each axis value."""
        known = known_keys()
        for section, keys in (("base", self.base), ("axes", self.axes)):
            for key in keys:
                if key not in known:
                    raise fail(f"unknown config field; allowed: {', '.join(known)}", section, key)
        base_fields = self.config_fields()
        try:
            RunConfig.from_dict(base_fields)
        except ConfigError as exc:
            raise fail(str(exc), "base") from None
        for key, values in self.axes.items():
            if key in CLUSTER_KEYS:
                continue  # checked with the point, where its worker count is known
            for i, value in enumerate(values):
                try:
                    RunConfig.from_dict({**base_fields, **_expand(key, value)})
                except ConfigError as exc:
                    raise fail(str(exc), "axes", key, i) from None
        return self

    def config_fields(self, combo: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """RunConfig fields of `base` with the axis values of `combo` (axis -> value) applied, aliases
        and variants expanded; the per-container keys left out."""
        fields: dict[str, Any] = {}
        for key, value in [*self.base.items(), *(combo or {}).items()]:
            if key not in CLUSTER_KEYS:
                fields.update(_expand(key, value))
        return fields

    @property
    def param_names(self) -> list[str]:
        """The axes' names, in the order of the file (the columns of a point's `params`)."""
        return list(self.axes)

    def to_dict(self) -> dict[str, Any]:
        """The spec as written (plus `source`), as a report records it: name, description, repeats,
        base, axes, reference, timeout_s, source, link_presets, faults (dicts), host_sysctls."""
        return {
            "name": self.name, "description": self.description, "repeats": self.repeats,
            "base": self.base, "axes": self.axes, "reference": self.reference,
            "timeout_s": self.timeout_s, "source": self.source, "link_presets": self.link_presets,
            "faults": [f.to_dict() for f in self.faults], "host_sysctls": self.host_sysctls,
        }


def _expand(name: str, value: Any) -> dict[str, Any]:
    if _is_variant(name, value):  # several fields at once, e.g. engine: {engine: ddp, ddp_comm_hook: fp16}
        fields: dict[str, Any] = {}
        for key, val in value.items():
            if key != "label":
                fields.update(_expand(key, val))
        return fields
    return {field_name: value for field_name in ALIASES.get(name, (name,))}


def _is_variant(name: str, value: Any) -> bool:
    """A mapping that names the axis's own field is a variant: one grid value setting several fields."""
    return isinstance(value, dict) and name in value


def _param_value(name: str, value: Any) -> Any:
    """What a point's `params` record for an axis value: a variant's ``label`` (or its values joined by '/')."""
    if _is_variant(name, value):
        return str(value.get("label") or "/".join(str(v) for k, v in value.items() if k != "label"))
    return value


def _points(spec: SweepSpec) -> list[Point]:
    """Every combination of the axes, in grid order, with its config and cluster settings.

    Raises SpecError naming the file and the point (or the cluster value's path)."""
    uses_link = "link" in spec.base or "link" in spec.axes
    presets = {**(load_presets() if uses_link else {}), **spec.link_presets}
    names = spec.param_names
    points = []
    for index, combo in enumerate(itertools.product(*(spec.axes[n] for n in names))):
        chosen = dict(zip(names, combo))
        try:
            config = RunConfig.from_dict(spec.config_fields(chosen))
        except ConfigError as exc:
            raise SpecError(f"{spec.source}: axes (point {chosen}): {exc}") from None
        cluster_values = {k: v for k, v in spec.base.items() if k in CLUSTER_KEYS}
        paths = {k: f"base.{k}" for k in cluster_values}
        for key, value in chosen.items():
            if key in CLUSTER_KEYS:
                cluster_values[key], paths[key] = value, f"axes.{key}[{spec.axes[key].index(value)}]"
        try:
            cluster = parse_cluster(cluster_values, presets, config.num_workers, paths)
        except SpecError as exc:
            raise SpecError(f"{spec.source}: {exc}") from None
        params = {n: param_label(v) if n in CLUSTER_KEYS else _param_value(n, v) for n, v in chosen.items()}
        points.append(Point(index=index, params=params, config=config, cluster=cluster))
    return points


def build_spec(data: Any, source: str = "<dict>") -> SweepSpec:
    """Validate a parsed spec (the mapping `yaml.safe_load` returns) and expand its grid.

    `source` names the file in messages; the spec's name defaults to its stem.

    Raises:
        SpecError: ``<source>: <field path>: <what is allowed>`` (e.g. ``axes.compression[2]``), for a
        bad key or value, a point RunConfig refuses, or a cluster value or fault target beyond a
        point's workers.
    """
    if isinstance(data, dict) and "name" not in data:
        data = {"name": Path(source).stem, **data}
    spec = validate(SweepSpec, data, source)
    spec.source = source
    spec.points = _points(spec)
    check_targets(spec.faults, source, min((p.config.num_workers for p in spec.points), default=None))
    return spec


def load_spec(path: str | Path) -> SweepSpec:
    """Read and validate a YAML sweep spec (see `build_spec`).

    Raises:
        SpecError: the file is missing or unreadable, not valid YAML, an alias bomb (`load_yaml`), or\n            has a bad field.
    """
    path = Path(path)
    return build_spec(load_yaml_file(path), str(path))


def select_points(spec: SweepSpec, selections: list[str]) -> SweepSpec:
    """Keep only the points of `spec` whose swept values match every selection, and number them again
    from 0 (in grid order). A selection is ``AXIS=GLOB[,GLOB...]`` (shell-style globs, `fnmatch`, matched
    against the axis's value or its label as the report shows it, e.g. ``model=lm-*,mlp-*``). The
    spec's description records the selection. Returns `spec`, changed in place.

    Raises:
        SpecError: a selection without ``=``, an axis the spec does not sweep, or no point left.
    """
    wanted: list[tuple[str, list[str]]] = []
    axes = list(spec.axes)
    for text in selections:
        axis, sep, globs = text.partition("=")
        if not sep or not axis or not globs:
            raise SpecError(f"{spec.source}: --only {text!r}: expected AXIS=GLOB[,GLOB...], e.g. model=mlp-*")
        if axis not in axes:
            raise SpecError(f"{spec.source}: --only {text!r}: {axis!r} is not an axis of this spec "
                            f"(allowed: {', '.join(axes) or 'none: the spec has no axes'})")
        wanted.append((axis, [g for g in globs.split(",") if g]))
    kept = [p for p in spec.points
            if all(any(fnmatch.fnmatchcase(str(p.params.get(axis)), g) for g in globs) for axis, globs in wanted)]
    if not kept:
        raise SpecError(f"{spec.source}: --only {' '.join(selections)} matches none of the {len(spec.points)} points")
    spec.points = [p.model_copy(update={"index": i}) for i, p in enumerate(kept)]
    spec.description = (f"{spec.description} " if spec.description else "") + f"[points: --only {' '.join(selections)}]"
    return spec
