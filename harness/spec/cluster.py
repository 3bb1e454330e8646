"""Per-container settings of a sweep point that are not node knobs: link profiles, CPU and memory limits.

A sweep spec sets them under ``base:`` or ``axes:`` with the keys ``link``, ``cpus`` and
``mem_limit``. Each takes one value for every container, or a mapping by role and worker::

    link: wan-100m-20ms                       # a preset (experiments/links.yaml, link_presets)
    link: {rate: 100mbit, delay: 20ms}        # an inline profile
    link: {coordinator: rate-100m, worker: lan-1g, worker-2: {rate: 10mbit}, allow_partial: true}
    cpus: 0.5                                 # Compose `cpus` (0: no limit)
    cpus: {worker-2: 0.25}                    # one slow worker: a straggler
    mem_limit: {coordinator: 2GiB}            # Compose `mem_limit` (0: no limit)

Keys of a mapping: ``all``, ``coordinator``, ``worker`` (every worker) and ``worker-N`` (the Nth
worker container, Compose's container number, e.g. ``<project>_worker_2``); the most specific key
wins, and ``none`` (or null) means explicitly unshaped / unlimited. ``allow_partial`` (link only)
applies what the kernel can and records the rest as unsupported instead of failing the point.

Role-wide limits go to Compose (``WIIIIIDE_COORDINATOR_CPUS`` and friends in compose.yaml); when a
``worker-N`` key is present, every worker's limit is set through the Engine API after start (before
training starts, behind the coordinator's start gate).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Generic, Mapping, TypeVar

import yaml

from harness import REPO_ROOT
from harness.errors import SpecError
from harness.spec.links import PROFILE_KEYS, LinkProfile

PRESETS_FILE = REPO_ROOT / "experiments" / "links.yaml"
CLUSTER_KEYS = ("link", "cpus", "mem_limit")
ROLE_KEYS = ("all", "coordinator", "worker")
_WORKER_KEY = re.compile(r"^worker-(\d+)$")
MIN_MEM_BYTES = 6 * 1024 * 1024  # Docker refuses less
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(b|k|kb|kib|m|mb|mib|g|gb|gib)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {None: 1, "b": 1, "k": 2**10, "kb": 2**10, "kib": 2**10, "m": 2**20, "mb": 2**20, "mib": 2**20,
               "g": 2**30, "gb": 2**30, "gib": 2**30}

T = TypeVar("T")


@dataclass(frozen=True)
class PerContainer(Generic[T]):
    """Values by ``all`` / ``coordinator`` / ``worker`` / ``worker-N``; `for_container` picks the most
    specific. A key present with None means "explicitly none" and overrides a broader key."""

    values: Mapping[str, T | None]

    def for_container(self, role: str, index: int | None = None) -> T | None:
        keys = ["coordinator", "all"] if role == "coordinator" else [f"worker-{index}", "worker", "all"]
        for key in keys:
            if key in self.values:
                return self.values[key]
        return None

    @property
    def has_worker_keys(self) -> bool:
        return any(_WORKER_KEY.match(k) for k in self.values)

    def max_worker_index(self) -> int:
        return max((int(m.group(1)) for m in map(_WORKER_KEY.match, self.values) if m), default=0)

    def to_dict(self, leaf: Callable[[T], Any] = lambda v: v) -> dict[str, Any]:
        return {k: (leaf(v) if v is not None else None) for k, v in self.values.items()}


def _per_container(value: Any, parse_leaf: Callable[[Any, str], T], path: str,
                   extra_keys: tuple[str, ...] = ()) -> PerContainer[T]:
    """A scalar applies to ``all``; a mapping is read by role keys. Raises SpecError naming the path."""
    if not isinstance(value, dict):
        return PerContainer({"all": parse_leaf(value, path)})
    values: dict[str, T | None] = {}
    for key, leaf in value.items():
        key = str(key)
        if key in extra_keys:
            continue
        if key not in ROLE_KEYS and not _WORKER_KEY.match(key):
            raise SpecError(f"{path}.{key}: unknown key; allowed: {', '.join(ROLE_KEYS + extra_keys)}, worker-N")
        if _WORKER_KEY.match(key) and int(_WORKER_KEY.match(key).group(1)) < 1:
            raise SpecError(f"{path}.{key}: workers are numbered from 1")
        values[key] = parse_leaf(leaf, f"{path}.{key}")
    return PerContainer(values)


# --------------------------------------------------------------------------------------------
# link


@dataclass(frozen=True)
class LinkSetting:
    """The link profiles of one point, by container, and whether missing kernel features may be skipped."""

    profiles: PerContainer[LinkProfile]
    allow_partial: bool = False
    label: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"label": self.label, "allow_partial": self.allow_partial,
                "profiles": self.profiles.to_dict(LinkProfile.to_dict)}


def load_presets(path: Path = PRESETS_FILE) -> dict[str, Any]:
    """The ``link_presets`` mapping of `path` (experiments/links.yaml). Raises SpecError if unreadable."""
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise SpecError(f"{path}: cannot read the link presets: {exc}") from None
    presets = data.get("link_presets") or {}
    if not isinstance(presets, dict):
        raise SpecError(f"{path}: link_presets: expected a mapping of name to profile")
    return presets


def parse_profile(value: Any, presets: Mapping[str, Any], path: str) -> LinkProfile | None:
    """A preset name, ``none``/null (unshaped) or an inline mapping of profile keys."""
    if value is None or (isinstance(value, str) and value.lower() == "none"):
        return None
    if isinstance(value, str):
        if value not in presets:
            raise SpecError(f"{path}: unknown link preset {value!r}; known: {', '.join(sorted(presets)) or 'none'}"
                            f" (link_presets in {PRESETS_FILE.relative_to(REPO_ROOT)} or in the spec)")
        preset = presets[value]
        if not isinstance(preset, dict):
            raise SpecError(f"{path}: link preset {value!r} must be a mapping of profile keys")
        name = value
    elif isinstance(value, dict):
        preset, name = value, "inline"
    else:
        raise SpecError(f"{path}: {value!r}: expected a preset name or a mapping of profile keys")
    try:
        return LinkProfile.from_mapping(preset, name)
    except SpecError as exc:
        raise SpecError(f"{path}: {exc}") from None


def parse_link(value: Any, presets: Mapping[str, Any], path: str) -> LinkSetting | None:
    """A ``link`` value: one profile for every container, or a mapping by role (see the module doc)."""
    if value is None or (isinstance(value, str) and value.lower() == "none"):
        return None
    allow_partial = False
    if isinstance(value, dict):
        allow_partial = value.get("allow_partial", False)
        if not isinstance(allow_partial, bool):
            raise SpecError(f"{path}.allow_partial: {allow_partial!r} must be true or false")
        profile_keys = set(value) & set(PROFILE_KEYS)
        if profile_keys:  # an inline profile for every container (with allow_partial beside it)
            stray = sorted(set(value) - set(PROFILE_KEYS) - {"allow_partial"})
            if stray:
                raise SpecError(f"{path}.{stray[0]}: a profile mapping takes only profile keys "
                                f"({', '.join(PROFILE_KEYS)}) and allow_partial; for roles use all/coordinator/worker")
            inline = {k: v for k, v in value.items() if k != "allow_partial"}
            profiles = PerContainer({"all": parse_profile(inline, presets, path)})
            return LinkSetting(profiles, allow_partial, str(param_label(value)))
    profiles = _per_container(value, lambda v, p: parse_profile(v, presets, p), path, extra_keys=("allow_partial",))
    if not profiles.values:
        raise SpecError(f"{path}: no profile: give a preset name, profile keys ({', '.join(PROFILE_KEYS)}) "
                        f"or all/coordinator/worker/worker-N keys")
    if all(p is None for p in profiles.values.values()):
        return None  # every container explicitly unshaped
    return LinkSetting(profiles, allow_partial, str(param_label(value)))


def param_label(value: Any) -> Any:
    """What a point's `params` shows for a link/cpus/mem_limit value: the value itself when it is a
    scalar, else a compact ``key=value`` line (inline profiles shown as ``inline``)."""
    if not isinstance(value, dict):
        return value
    parts = []
    for key, leaf in value.items():
        shown = "inline" if isinstance(leaf, dict) else leaf
        if key == "allow_partial":
            continue
        parts.append(str(shown) if key == "all" else f"{key}={shown}")
    return " ".join(parts) + (" (partial)" if value.get("allow_partial") else "")


# --------------------------------------------------------------------------------------------
# cpus and mem_limit


def parse_cpus(value: Any, path: str) -> float | None:
    """CPUs (Compose ``cpus``): 0 or none for no limit, else 0.01 .. this machine's cores."""
    if value is None or (isinstance(value, str) and value.lower() == "none"):
        return None
    try:
        cpus = float(value)
    except (TypeError, ValueError):
        raise SpecError(f"{path}: {value!r} is not a number of CPUs (e.g. 0.5; 0: no limit)") from None
    cores = os.cpu_count() or 1
    if isinstance(value, bool) or not (cpus == 0 or 0.01 <= cpus <= cores):
        raise SpecError(f"{path}: {value!r} CPUs; allowed: 0 (no limit) or 0.01..{cores} (this machine's cores)")
    return cpus or None


def parse_mem_bytes(value: Any, path: str) -> int | None:
    """Memory limit (Compose ``mem_limit``): ``512MiB``, ``2g`` or bytes; 0 or none for no limit."""
    if value is None or (isinstance(value, str) and value.lower() == "none"):
        return None
    match = _SIZE_RE.match(str(value)) if not isinstance(value, bool) else None
    if not match:
        raise SpecError(f"{path}: {value!r} is not a size: write e.g. 512MiB, 2GiB (0: no limit)")
    unit = match.group(2).lower() if match.group(2) else None
    size = int(float(match.group(1)) * _SIZE_UNITS[unit])
    if size and size < MIN_MEM_BYTES:
        raise SpecError(f"{path}: {value!r} is below Docker's minimum of 6 MiB")
    return size or None


# --------------------------------------------------------------------------------------------
# the point's settings


@dataclass(frozen=True)
class ClusterSettings:
    """What a point asks of its containers besides node knobs (None: nothing asked)."""

    link: LinkSetting | None = None
    cpus: PerContainer[float] | None = None
    mem_limit: PerContainer[int] | None = None

    @property
    def is_empty(self) -> bool:
        return self.link is None and self.cpus is None and self.mem_limit is None

    def to_dict(self) -> dict[str, Any]:
        return {"link": self.link.to_dict() if self.link else None,
                "cpus": self.cpus.to_dict() if self.cpus else None,
                "mem_limit_bytes": self.mem_limit.to_dict() if self.mem_limit else None}

    def max_worker_index(self) -> int:
        parts = [self.link.profiles if self.link else None, self.cpus, self.mem_limit]
        return max((p.max_worker_index() for p in parts if p is not None), default=0)

    def compose_env(self) -> dict[str, str]:
        """Compose variables for role-wide limits (compose.yaml's defaults mean no limit)."""
        env = {}
        for name, values in (("CPUS", self.cpus), ("MEM_LIMIT", self.mem_limit)):
            if values is None:
                continue
            coordinator = values.for_container("coordinator")
            if coordinator:
                env[f"WIIIIIDE_COORDINATOR_{name}"] = str(coordinator)
            worker = values.for_container("worker", 0)  # no worker-0: the role-wide value
            if worker and not values.has_worker_keys:
                env[f"WIIIIIDE_WORKER_{name}"] = str(worker)
        return env

    def worker_updates(self, index: int) -> dict[str, Any]:
        """docker SDK ``container.update`` arguments for worker `index` when limits are set per worker
        (Compose cannot: ``--scale`` gives every worker the same); {} when none apply."""
        update: dict[str, Any] = {}
        if self.cpus is not None and self.cpus.has_worker_keys:
            cpus = self.cpus.for_container("worker", index)
            if cpus:
                update.update(cpu_period=100_000, cpu_quota=int(round(cpus * 100_000)))
        if self.mem_limit is not None and self.mem_limit.has_worker_keys:
            mem = self.mem_limit.for_container("worker", index)
            if mem:
                update.update(mem_limit=mem, memswap_limit=2 * mem)  # swap = memory, Docker's default
        return update


def parse_cluster(values: Mapping[str, Any], presets: Mapping[str, Any], num_workers: int,
                  paths: Mapping[str, str]) -> ClusterSettings:
    """Build a point's settings from its ``link``/``cpus``/``mem_limit`` values.

    `paths` gives each key's place in the spec for messages (e.g. ``axes.link[2]``).
    Raises SpecError naming that path, including a ``worker-N`` beyond the point's `num_workers`.
    """
    link = parse_link(values["link"], presets, paths["link"]) if "link" in values else None
    cpus = _none_if_empty(_per_container(values["cpus"], parse_cpus, paths["cpus"])) if "cpus" in values else None
    mem = (_none_if_empty(_per_container(values["mem_limit"], parse_mem_bytes, paths["mem_limit"]))
           if "mem_limit" in values else None)
    settings = ClusterSettings(link, cpus, mem)
    top = settings.max_worker_index()
    if top > num_workers:
        key = next(k for k in CLUSTER_KEYS if k in values and f"worker-{top}" in str(values[k]))
        raise SpecError(f"{paths[key]}: worker-{top} but the point has {num_workers} workers")
    return settings


def _none_if_empty(values: PerContainer) -> PerContainer | None:
    return values if any(v is not None for v in values.values.values()) else None
