"""Per-container settings of a sweep point that are not node knobs: link profiles, CPU and memory limits.

A sweep spec sets them under ``base:`` or ``axes:`` with the keys ``link``, ``cpus`` and
``mem_limit``. Each takes one value for every container, or a mapping by role and worker::

    link: wan-100m-20ms                       # a preset (experiments/links.yaml, link_presets)
    link: {rate: 100mbit, delay: 20ms}        # an inline profile
    link: {coordinator: rate-100m, worker: lan-1g, worker-2: {rate: 10mbit}, allow_partial: true}
    cpus: 0.5                                 # Compose `cpus` (0: no limit)
    cpus: {worker-2: 0.25}                    # one slow worker: a straggler
    mem_limit: {coordinator: 2GiB}            # Compose `mem_limit` (0: no limit), IEC (wiiide.units)
    cpu_period_s: 0.01                        # the workers' CPU limits as a CFS quota per 10 ms, not Docker's 100 ms
    overlay_encrypted: true                   # swarm only: the stack's overlay with `--opt encrypted`

Keys of a mapping: ``all``, ``coordinator``, ``worker`` (every worker) and ``worker-N`` (the Nth
worker container, Compose's container number, e.g. ``<project>_worker_2``); the most specific key
wins, and ``none`` (or null) means explicitly unshaped / unlimited. ``overlay_encrypted`` is one
boolean for the whole run (a network has no per-container setting); only the swarm backend applies it. ``allow_partial`` (link only)
applies what the kernel can and records the rest as unsupported instead of failing the point.

``cpu_period_s`` (0.001 .. 1 s; default none: Docker's 100 ms) is the CFS period of the workers' CPU
limits: a container at 0.25 CPU runs 25 ms and then stalls 75 ms in every 100 ms period, a bursty
straggler unlike a slower machine; with 0.01 it runs 2.5 ms in every 10 ms. It applies to worker limits
(set through the Engine API, as with ``worker-N`` keys); a coordinator limit keeps Docker's period.

Role-wide limits go to Compose (``WIIIIIDE_COORDINATOR_CPUS`` and friends in compose.yaml); when a
``worker-N`` key is present, every worker's limit is set through the Engine API after start (before
training starts, behind the coordinator's start gate).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Annotated, Any, Callable, Generic, Mapping, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PlainValidator,
    TypeAdapter,
    ValidationInfo,
)
from pydantic_core import PydanticCustomError

from harness import REPO_ROOT
from harness.errors import SpecError
from harness.spec.base import SpecModel, fail, shown, unit, validate
from harness.spec.link_forms import ScheduledProfile, TopologyForm, TraceProfile, form_label
from harness.spec.links import PROFILE_KEYS, LinkProfile
from harness.spec.pairs import Topology, is_topology, parse_topology
from harness.spec.timeline import is_timed, parse_timed
from harness.spec.yaml_file import load_yaml_file
from wiiide.units import parse_size_bytes

PRESETS_FILE = REPO_ROOT / "experiments" / "links.yaml"
CLUSTER_KEYS = ("link", "cpus", "mem_limit", "overlay_encrypted", "cpu_period_s")
DOCKER_CPU_PERIOD_US = 100_000  # Docker's CFS period for --cpus (NanoCpus)
ROLE_KEYS = ("all", "coordinator", "worker")
ROLE_KEY_PATTERN = r"^(all|coordinator|worker|worker-[1-9][0-9]*)$"
_WORKER_KEY = re.compile(r"^worker-(\d{1,6})$")  # at most 6 digits: int() never sees a huge number
MIN_MEM_BYTES = 6 * 1024 * 1024  # Docker refuses less

T = TypeVar("T")


class PerContainer(SpecModel, Generic[T]):
    """Values by ``all`` / ``coordinator`` / ``worker`` / ``worker-N``; `for_container` picks the most
    specific. A key present with None means "explicitly none" and overrides a broader key."""

    values: dict[str, T | None]

    def for_container(self, role: str, index: int | None = None) -> T | None:
        """The value for the ``coordinator`` or for worker `index` (1-based); None: nothing asked."""
        keys = ["coordinator", "all"] if role == "coordinator" else [f"worker-{index}", "worker", "all"]
        for key in keys:
            if key in self.values:
                return self.values[key]
        return None

    @property
    def has_worker_keys(self) -> bool:
        """Whether some ``worker-N`` key is set (then limits go through the Engine API per worker)."""
        return any(_WORKER_KEY.match(k) for k in self.values)

    def max_worker_index(self) -> int:
        """The largest N of the ``worker-N`` keys (0: none)."""
        return max((int(m.group(1)) for m in map(_WORKER_KEY.match, self.values) if m), default=0)

    def to_dict(self, leaf: Callable[[T], Any] = lambda v: v) -> dict[str, Any]:
        """key -> `leaf(value)` (None stays None), as reports record it."""
        return {k: (leaf(v) if v is not None else None) for k, v in self.values.items()}


def _is_none(value: Any) -> bool:
    return value is None or (isinstance(value, str) and value.lower() == "none")


def _per_container(value: Any, parse_leaf: Callable[[Any], T], extra_keys: tuple[str, ...] = ()) -> PerContainer[T]:
    """A scalar applies to ``all``; a mapping is read by role keys. Raises ValueError / `fail` (validators)."""
    if not isinstance(value, Mapping):
        return PerContainer(values={"all": parse_leaf(value)})
    values: dict[str, T | None] = {}
    for key, leaf in value.items():
        key = str(key)
        if key in extra_keys:
            continue
        worker = _WORKER_KEY.match(key)
        if key not in ROLE_KEYS and not worker:
            raise fail(f"unknown key; allowed: {', '.join(ROLE_KEYS + extra_keys)}, worker-N", key)
        if worker and int(worker.group(1)) < 1:
            raise fail("workers are numbered from 1", key)
        try:
            values[key] = parse_leaf(leaf)
        except PydanticCustomError as exc:
            raise fail(exc.message(), key, *(exc.context or {}).get("path", ())) from None
        except ValueError as exc:
            raise fail(str(exc), key) from None
    return PerContainer(values=values)


def _none_if_empty(values: PerContainer) -> PerContainer | None:
    return values if any(v is not None for v in values.values.values()) else None


# --------------------------------------------------------------------------------------------
# link


class LinkSetting(SpecModel):
    """The link profiles of one point, by container, whether missing kernel features may be skipped
    (`allow_partial`), and the label a point's params show for it."""

    profiles: PerContainer[LinkProfile]
    allow_partial: bool = False
    label: str = ""
    topology: Topology | None = None  # links by pair of nodes (harness.spec.pairs); then `profiles` is empty

    def to_dict(self) -> dict[str, Any]:
        """``{"label", "allow_partial", "profiles": {key: LinkProfile.to_dict() or None}}``, and
        ``"topology"`` (`Topology.to_dict`) for links by pair."""
        return {"label": self.label, "allow_partial": self.allow_partial,
                "profiles": self.profiles.to_dict(lambda p: p.to_dict()),
                **({"topology": self.topology.to_dict()} if self.topology is not None else {})}


def load_presets(path: Path = PRESETS_FILE) -> dict[str, Any]:
    """The ``link_presets`` mapping of `path` (experiments/links.yaml), as written ({} when it has none).

    Raises:
        SpecError: the file is unreadable or not YAML, or ``link_presets`` is not a mapping.
    """
    data = load_yaml_file(path) or {}
    if not isinstance(data, dict):
        raise SpecError(f"{path}: expected a mapping with link_presets")
    presets = data.get("link_presets") or {}
    if not isinstance(presets, dict):
        raise SpecError(f"{path}: link_presets: expected a mapping of name to profile")
    return presets


def _profile(value: Any, presets: Mapping[str, Any]) -> LinkProfile | None:
    """A preset name, ``none``/null (unshaped) or an inline mapping of profile keys. Raises ValueError."""
    if _is_none(value):
        return None
    if isinstance(value, str):
        if value not in presets:
            raise ValueError(f"unknown link preset {value!r}; known: {', '.join(sorted(presets)) or 'none'}"
                             f" (link_presets in {PRESETS_FILE.relative_to(REPO_ROOT)} or in the spec)")
        preset, name = presets[value], value
        if not isinstance(preset, Mapping):
            raise ValueError(f"link preset {value!r} must be a mapping of profile keys")
    elif isinstance(value, Mapping):
        preset, name = value, "inline"
    else:
        raise ValueError(f"{shown(value)}: expected a preset name or a mapping of profile keys")
    if is_timed(preset):  # a schedule or a trace: its errors name their path below the value
        return parse_timed(preset, name)
    try:
        return LinkProfile.from_mapping(preset, name)
    except SpecError as exc:
        raise ValueError(str(exc)) from None


def _link(value: Any, info: ValidationInfo) -> LinkSetting | None:
    """Validator of a ``link`` value (see the module doc); the presets come in ``info.context``."""
    presets: Mapping[str, Any] = (info.context or {}).get("presets", {})
    if _is_none(value):
        return None
    allow_partial = False
    if isinstance(value, Mapping):
        allow_partial = value.get("allow_partial", False)
        if not isinstance(allow_partial, bool):
            raise fail(f"{shown(allow_partial)}; allowed: true or false", "allow_partial")
        if is_topology(value):  # links by pair of nodes
            topology = parse_topology(value, lambda v: _profile(v, presets))
            return LinkSetting(profiles=PerContainer(values={}), allow_partial=allow_partial,
                               label=str(param_label(value)), topology=topology)
        if is_timed(value):  # a schedule or a trace for every container
            timed = parse_timed({k: v for k, v in value.items() if k != "allow_partial"})
            return LinkSetting(profiles=PerContainer(values={"all": timed}), allow_partial=allow_partial,
                               label=str(param_label(value)))
        if set(value) & set(PROFILE_KEYS):  # an inline profile for every container (with allow_partial beside it)
            stray = sorted(set(value) - set(PROFILE_KEYS) - {"allow_partial"})
            if stray:
                raise fail(f"a profile mapping takes only profile keys ({', '.join(PROFILE_KEYS)}) and "
                           f"allow_partial; for roles use all/coordinator/worker", stray[0])
            inline = {k: v for k, v in value.items() if k != "allow_partial"}
            profiles = PerContainer(values={"all": _profile(inline, presets)})
            return LinkSetting(profiles=profiles, allow_partial=allow_partial, label=str(param_label(value)))
    profiles = _per_container(value, lambda v: _profile(v, presets), extra_keys=("allow_partial",))
    if not profiles.values:
        raise ValueError(f"no profile: give a preset name, profile keys ({', '.join(PROFILE_KEYS)}) "
                         f"or all/coordinator/worker/worker-N keys")
    if all(p is None for p in profiles.values.values()):
        return None  # every container explicitly unshaped
    return LinkSetting(profiles=profiles, allow_partial=allow_partial, label=str(param_label(value)))


def param_label(value: Any) -> Any:
    """What a point's `params` shows for a link/cpus/mem_limit value: the value itself when it is a
    scalar, else a compact ``key=value`` line (inline profiles shown as ``inline``)."""
    if not isinstance(value, dict):
        return value
    parts = []
    for key, leaf in value.items():
        shown_leaf = "inline" if isinstance(leaf, dict) else leaf
        if (form := form_label(key, leaf)) is not None:  # a schedule, a trace, pairs
            parts.append(form)
            continue
        if key == "allow_partial":
            continue
        parts.append(str(shown_leaf) if key == "all" else f"{key}={shown_leaf}")
    return " ".join(parts) + (" (partial)" if value.get("allow_partial") else "")


# --------------------------------------------------------------------------------------------
# cpus and mem_limit


def _cpus(value: Any) -> float | None:
    """CPUs (Compose ``cpus``): 0 or none for no limit, else 0.01 .. this machine's cores. Raises ValueError."""
    if _is_none(value):
        return None
    try:
        cpus = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{shown(value)} is not a number of CPUs (e.g. 0.5; 0: no limit)") from None
    cores = os.cpu_count() or 1
    if isinstance(value, bool) or not (cpus == 0 or 0.01 <= cpus <= cores):
        raise ValueError(f"{shown(value)} CPUs; allowed: 0 (no limit) or 0.01..{cores} (this machine's cores)")
    return cpus or None


def _mem_bytes(value: Any) -> int | None:
    """Memory limit (Compose ``mem_limit``), IEC: ``512MiB``, ``2g`` or bytes; 0 or none for no limit.
    Raises ValueError."""
    if _is_none(value):
        return None
    size = unit(parse_size_bytes, value)
    if size and size < MIN_MEM_BYTES:
        raise ValueError(f"{shown(value)} is below Docker's minimum of 6 MiB")
    return size or None


def _cpu_period_s(value: Any) -> float | None:
    """The workers' CFS period in seconds: 0.001 .. 1 (the kernel's cfs_period_us range); none for
    Docker's 100 ms. Raises ValueError."""
    if _is_none(value):
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.001 <= value <= 1.0:
        raise ValueError(f"{shown(value)}; allowed: seconds 0.001..1 (e.g. 0.01), or none for Docker's 0.1")
    return float(value)


# ---------------------------------------------------------------------------- the YAML forms (typed)
# What a spec file may write for each key; the validators above read it, the JSON Schema
# (harness.spec.schema) shows it. RoleKey: all / coordinator / worker / worker-N.

RoleKey = Annotated[str, Field(pattern=ROLE_KEY_PATTERN)]
_Cpus = float | None
_Mem = Annotated[int | str | None, Field(description="bytes or an IEC size (512MiB, 2GiB); 0 or none: no limit")]


class LinkByRole(BaseModel):
    """Schema only (the validator is `_link`): a ``link`` mapping by role, e.g. ``{coordinator: rate-100m, worker: lan-1g}``."""

    model_config = ConfigDict(extra="forbid", json_schema_extra=lambda s: s.update(patternProperties={
        r"^worker-[1-9][0-9]*$": {"anyOf": s["properties"]["worker"]["anyOf"]}}))
    all: str | LinkProfile | ScheduledProfile | TraceProfile | None = None
    coordinator: str | LinkProfile | ScheduledProfile | TraceProfile | None = None
    worker: str | LinkProfile | ScheduledProfile | TraceProfile | None = None
    allow_partial: bool = False


class InlineLink(LinkProfile):
    """Schema only (the validator is `_link`): an inline profile for every container, with ``allow_partial`` beside its keys."""

    yaml_keys = (*PROFILE_KEYS, "allow_partial")
    allow_partial: bool = False


LinkValue = Annotated[LinkSetting | None, PlainValidator(_link, json_schema_input_type=(
    str | None | InlineLink | ScheduledProfile | TraceProfile | TopologyForm | LinkByRole))]
"""A ``link`` value: a preset name, none, an inline profile or a mapping by role (context: ``presets``)."""
CpusValue = Annotated[PerContainer[float] | None, PlainValidator(
    lambda v: _none_if_empty(_per_container(v, _cpus)), json_schema_input_type=_Cpus | dict[RoleKey, _Cpus]),
    Field(description="CPUs (0 or none: no limit), for every container or by role")]
MemValue = Annotated[PerContainer[int] | None, PlainValidator(
    lambda v: _none_if_empty(_per_container(v, _mem_bytes)), json_schema_input_type=_Mem | dict[RoleKey, _Mem]),
    Field(description="memory limit (0 or none: no limit), for every container or by role")]
OverlayEncryptedValue = Annotated[bool, Field(strict=True, description=(
    "swarm only: create the stack's overlay network with driver_opts encrypted (IPsec ESP between hosts); "
    "true or false"))]
CpuPeriodValue = Annotated[float | None, PlainValidator(_cpu_period_s, json_schema_input_type=float | None),
                          Field(description="the workers' CFS period for their CPU limits, seconds 0.001..1 "
                                            "(none: Docker's 0.1)")]
_ADAPTERS = {"link": TypeAdapter(LinkValue), "cpus": TypeAdapter(CpusValue), "mem_limit": TypeAdapter(MemValue),
             "overlay_encrypted": TypeAdapter(OverlayEncryptedValue), "cpu_period_s": TypeAdapter(CpuPeriodValue)}


def parse_link(value: Any, presets: Mapping[str, Any], path: str) -> LinkSetting | None:
    """A ``link`` value: one profile for every container, or a mapping by role (see the module doc).
    `presets` maps preset names to profile mappings; `path` is the value's place in the spec.

    Returns None when no container is shaped. Raises SpecError: ``<path>[.<key>]: ...``.
    """
    return validate(_ADAPTERS["link"], value, path=path, context={"yaml": True, "presets": presets})


def parse_cpus(value: Any, path: str) -> float | None:
    """One CPU limit (Compose ``cpus``): 0 or none -> None, else 0.01 .. this machine's cores.
    Raises SpecError naming `path`."""
    return validate(TypeAdapter(Annotated[float | None, PlainValidator(_cpus)]), value, path=path)


def parse_mem_bytes(value: Any, path: str) -> int | None:
    """One memory limit (Compose ``mem_limit``) in bytes: ``512MiB``, ``2g`` (IEC, wiiide.units) or a
    byte count; 0 or none -> None. Raises SpecError naming `path` (below 6 MiB: Docker's minimum)."""
    return validate(TypeAdapter(Annotated[int | None, PlainValidator(_mem_bytes)]), value, path=path)


# --------------------------------------------------------------------------------------------
# the point's settings


class ClusterSettings(SpecModel):
    """What a point asks of its containers besides node knobs (None: nothing asked): `link` profiles,
    `cpus` (CPUs) and `mem_limit` (bytes), each by container; and of its network: `overlay_encrypted`
    (swarm only: the stack's overlay network created with ``driver_opts: {encrypted: ""}``)."""

    link: LinkSetting | None = None
    cpus: PerContainer[float] | None = None
    mem_limit: PerContainer[int] | None = None
    overlay_encrypted: bool = False
    cpu_period_s: float | None = None

    @property
    def is_empty(self) -> bool:
        """Whether nothing is asked of the containers (no link shaping, no limits): nothing to set up
        in them behind the start gate. `overlay_encrypted` is the network's, set when it is created."""
        return self.link is None and self.cpus is None and self.mem_limit is None

    def to_dict(self) -> dict[str, Any]:
        """``{"link": LinkSetting.to_dict() | None, "cpus": {key: CPUs} | None, "mem_limit_bytes": ...}``,
        plus ``"overlay_encrypted": true`` and ``"cpu_period_s"`` when asked (absent: a plain overlay and
        Docker's 100 ms period, as in reports from before the keys)."""
        return {"link": self.link.to_dict() if self.link else None,
                "cpus": self.cpus.to_dict() if self.cpus else None,
                "mem_limit_bytes": self.mem_limit.to_dict() if self.mem_limit else None,
                **({"overlay_encrypted": True} if self.overlay_encrypted else {}),
                **({"cpu_period_s": self.cpu_period_s} if self.cpu_period_s is not None else {})}

    def max_worker_index(self) -> int:
        """The largest N of any ``worker-N`` key (0: none)."""
        parts = [self.link.profiles if self.link else None, self.cpus, self.mem_limit]
        return max((p.max_worker_index() for p in parts if p is not None), default=0)

    def _workers_cpus_by_api(self) -> bool:
        """Whether the workers' CPU limits go through the Engine API (a ``worker-N`` key, or a CFS period
        of our own, which Compose's ``cpus`` cannot set) rather than Compose."""
        return self.cpus is not None and (self.cpus.has_worker_keys or self.cpu_period_s is not None)

    def compose_env(self) -> dict[str, str]:
        """Compose variables for role-wide limits (compose.yaml's defaults mean no limit): CPUs as a
        decimal, memory in bytes."""
        env = {}
        for name, values in (("CPUS", self.cpus), ("MEM_LIMIT", self.mem_limit)):
            if values is None:
                continue
            coordinator = values.for_container("coordinator")
            if coordinator:
                env[f"WIIIIIDE_COORDINATOR_{name}"] = str(coordinator)
            worker = values.for_container("worker", 0)  # no worker-0: the role-wide value
            by_api = self._workers_cpus_by_api() if name == "CPUS" else values.has_worker_keys
            if worker and not by_api:
                env[f"WIIIIIDE_WORKER_{name}"] = str(worker)
        return env

    def worker_updates(self, index: int) -> dict[str, Any]:
        """docker SDK ``container.update`` arguments for worker `index` when limits are set per worker
        (Compose cannot: ``--scale`` gives every worker the same), or with a `cpu_period_s` of their own;
        {} when none apply. CPUs become a CFS quota per period (`cpu_period_s`, else Docker's 100,000 us);
        swap is set equal to memory (memswap = 2 x memory), Docker's default."""
        update: dict[str, Any] = {}
        if self._workers_cpus_by_api():
            cpus = self.cpus.for_container("worker", index)
            if cpus:
                period_us = (int(round(self.cpu_period_s * 1e6)) if self.cpu_period_s is not None
                             else DOCKER_CPU_PERIOD_US)
                update.update(cpu_period=period_us, cpu_quota=int(round(cpus * period_us)))
        if self.mem_limit is not None and self.mem_limit.has_worker_keys:
            mem = self.mem_limit.for_container("worker", index)
            if mem:
                update.update(mem_limit=mem, memswap_limit=2 * mem)
        return update


def parse_cluster(values: Mapping[str, Any], presets: Mapping[str, Any], num_workers: int,
                  paths: Mapping[str, str]) -> ClusterSettings:
    """Build a point's settings from its ``link``/``cpus``/``mem_limit``/``overlay_encrypted`` values (as written in YAML).

    `presets` maps link preset names to profile mappings; `paths` gives each key's place in the spec
    for messages (e.g. ``axes.link[2]``).

    Raises:
        SpecError: naming that path and what is allowed, including a ``worker-N`` beyond the point's
        `num_workers`.
    """
    parsed = {key: validate(_ADAPTERS[key], values[key], path=paths[key], context={"yaml": True, "presets": presets})
              for key in CLUSTER_KEYS if key in values}
    settings = ClusterSettings(**parsed)
    if settings.cpu_period_s is not None and settings.cpus is not None:
        for index in range(1, num_workers + 1):  # the kernel's smallest CFS quota is 1 ms
            cpus = settings.cpus.for_container("worker", index)
            if cpus and cpus * settings.cpu_period_s < 0.001:
                raise SpecError(f"{paths['cpu_period_s']}: {settings.cpu_period_s:g} s x {cpus:g} CPUs for worker-{index} "
                                f"is a quota under the kernel's 1 ms; use a longer period")
    if settings.link is not None and settings.link.topology is not None:
        beyond = settings.link.topology.check_nodes(num_workers)
        if beyond is not None:
            raise SpecError(f"{paths['link']}.{beyond[0]}: {beyond[1]}")
    top = settings.max_worker_index()
    if top > num_workers:
        key = next(k for k in CLUSTER_KEYS if k in values and f"worker-{top}" in str(values[k]))
        raise SpecError(f"{paths[key]}: worker-{top} but the point has {num_workers} workers")
    return settings
