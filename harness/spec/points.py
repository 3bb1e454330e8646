"""Sweep specs: a YAML file under ``experiments/`` that names a base config and a grid of axes.

Format::

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
      link: [lan-1g, rate-100m]       # per-container settings (harness/cluster/settings.py): link
      cpus: [0, {worker-2: 0.25}]     # profiles (presets in experiments/links.yaml), cpus, mem_limit
      engine:                         # a mapping naming the axis's own field is a variant: one value
        - wiiide                      # that sets several fields; `label` names it in params and tables
        - {label: ddp-fp16, engine: ddp, ddp_comm_hook: fp16}
    reference:                        # optional: the seeds' figures, copied into the report
      ...

Every point's config is built and validated when the spec loads, so a bad value stops the sweep
before any container starts, with the file, the field path and what is allowed.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from harness.errors import SpecError
from harness.spec.cluster import (
    CLUSTER_KEYS,
    ClusterSettings,
    load_presets,
    param_label,
    parse_cluster,
)
from harness.spec.faults import Fault, parse_faults
from harness.spec.sysctls import parse_sysctls
from wiiide.config import RunConfig
from wiiide.errors import ConfigError

# Axis names that set several config fields at once.
ALIASES: dict[str, tuple[str, ...]] = {
    "buffer_bytes": ("sndbuf_bytes", "rcvbuf_bytes"),
    "workers": ("num_workers",),
}
TOP_LEVEL_KEYS = {"name", "description", "repeats", "base", "axes", "reference", "timeout_s", "link_presets",
                  "faults", "host_sysctls"}


@dataclass
class Point:
    """One grid point: its index, the swept values (`params`) and the full validated config."""

    index: int
    params: dict[str, Any]
    config: RunConfig
    # link, cpus, mem_limit: per-container settings that are not node knobs (harness/cluster/settings.py)
    cluster: ClusterSettings = field(default_factory=ClusterSettings)


@dataclass
class SweepSpec:
    name: str
    description: str
    repeats: int
    base: dict[str, Any]
    axes: dict[str, list[Any]]
    source: str
    reference: dict[str, Any] = field(default_factory=dict)
    timeout_s: float | None = None  # per repeat; default: derived from duration and connect timeout
    link_presets: dict[str, Any] = field(default_factory=dict)  # the spec's own, beside experiments/links.yaml's
    faults: list[Fault] = field(default_factory=list)  # injected in every run (harness.spec.faults, harness.run.faults)
    host_sysctls: dict[str, int] = field(default_factory=dict)  # set for the sweep (harness.spec.sysctls)
    points: list[Point] = field(default_factory=list)

    @property
    def param_names(self) -> list[str]:
        return list(self.axes)

    def to_dict(self) -> dict[str, Any]:
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


def build_spec(data: Any, source: str = "<dict>") -> SweepSpec:
    """Validate a parsed spec and expand its grid.

    Raises:
        SpecError: naming `source`, the field path (e.g. ``axes.compression[2]``) and what is allowed.
    """
    def fail(path: str, message: str) -> SpecError:
        return SpecError(f"{source}: {path}: {message}")

    if not isinstance(data, dict):
        raise fail("(top level)", "expected a mapping with keys " + ", ".join(sorted(TOP_LEVEL_KEYS)))
    unknown = sorted(set(data) - TOP_LEVEL_KEYS)
    if unknown:
        raise fail(unknown[0], f"unknown key; allowed: {', '.join(sorted(TOP_LEVEL_KEYS))}")
    name = data.get("name", Path(source).stem)
    if not isinstance(name, str) or not name or not all(c.isalnum() or c in "-_." for c in name):
        raise fail("name", f"{name!r} must be a non-empty string of letters, digits, '-', '_' or '.'")
    repeats = data.get("repeats", 1)
    if isinstance(repeats, bool) or not isinstance(repeats, int) or not 1 <= repeats <= 1000:
        raise fail("repeats", f"{repeats!r} must be an integer 1..1000")
    timeout_s = data.get("timeout_s")
    if timeout_s is not None and (isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or timeout_s <= 0):
        raise fail("timeout_s", f"{timeout_s!r} must be a positive number of seconds")
    base = data.get("base") or {}
    if not isinstance(base, dict):
        raise fail("base", "expected a mapping of config fields")
    axes = data.get("axes") or {}
    if not isinstance(axes, dict):
        raise fail("axes", "expected a mapping of axis name to a list of values")
    reference = data.get("reference") or {}
    if not isinstance(reference, dict):
        raise fail("reference", "expected a mapping")

    link_presets = data.get("link_presets") or {}
    if not isinstance(link_presets, dict):
        raise fail("link_presets", "expected a mapping of preset name to link profile")
    known = set(RunConfig.field_names()) | set(ALIASES) | set(CLUSTER_KEYS)
    for path, key in [(f"base.{k}", k) for k in base] + [(f"axes.{k}", k) for k in axes]:
        if key not in known:
            raise fail(path, f"unknown config field; allowed: {', '.join(sorted(known))}")
    base_fields: dict[str, Any] = {}
    for key, value in base.items():
        if key not in CLUSTER_KEYS:
            base_fields.update(_expand(key, value))
    try:
        RunConfig.from_dict(base_fields)
    except ConfigError as exc:
        raise fail("base", str(exc)) from None
    for key, values in axes.items():
        if not isinstance(values, list) or not values:
            raise fail(f"axes.{key}", "expected a non-empty list of values")
        for i, value in enumerate(values):
            if key in CLUSTER_KEYS:
                continue  # checked with the point below, where its worker count is known
            try:
                RunConfig.from_dict({**base_fields, **_expand(key, value)})
            except ConfigError as exc:
                raise fail(f"axes.{key}[{i}]", str(exc)) from None

    spec = SweepSpec(name=name, description=str(data.get("description", "")), repeats=repeats,
                     base=base, axes=axes, source=source, reference=reference,
                     timeout_s=float(timeout_s) if timeout_s is not None else None, link_presets=link_presets)
    uses_link = "link" in base or "link" in axes
    presets = {**(load_presets() if uses_link else {}), **link_presets}
    names = list(axes)
    for index, combo in enumerate(itertools.product(*(axes[n] for n in names))):
        fields = dict(base_fields)
        cluster_values = {k: v for k, v in base.items() if k in CLUSTER_KEYS}
        paths = {k: f"base.{k}" for k in cluster_values}
        for key, value in zip(names, combo):
            if key in CLUSTER_KEYS:
                cluster_values[key], paths[key] = value, f"axes.{key}[{axes[key].index(value)}]"
            else:
                fields.update(_expand(key, value))
        try:
            config = RunConfig.from_dict(fields)
        except ConfigError as exc:
            raise fail(f"axes (point {dict(zip(names, combo))})", str(exc)) from None
        try:
            cluster = parse_cluster(cluster_values, presets, config.num_workers, paths)
        except SpecError as exc:
            raise SpecError(f"{source}: {exc}") from None
        params = {n: param_label(v) if n in CLUSTER_KEYS else _param_value(n, v) for n, v in zip(names, combo)}
        spec.points.append(Point(index, params, config, cluster))
    min_workers = min((p.config.num_workers for p in spec.points), default=None)
    spec.faults = parse_faults(data.get("faults"), source, min_workers)
    spec.host_sysctls = parse_sysctls(data.get("host_sysctls"), source)
    return spec


def load_spec(path: str | Path) -> SweepSpec:
    """Read and validate a YAML sweep spec. Raises SpecError (missing file, bad YAML, bad field)."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise SpecError(f"{path}: cannot read: {exc.strerror or exc}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise SpecError(f"{path}: not valid YAML: {exc}") from None
    return build_spec(data, str(path))
