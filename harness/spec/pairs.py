"""Links between pairs of nodes, and small topologies made of them, as a spec writes them.

A ``link`` value with ``pairs`` or ``regions`` gives a link per pair of nodes instead of one per
container (nodes: ``coordinator`` and ``worker-1`` .. ``worker-N``)::

    link:                                   # a star with one slow worker
      pairs:
        - {between: [coordinator, worker-4], profile: {rate: 10mbit}}
      default: lan-1g                       # every other pair
    link:                                   # two regions: a LAN inside each, one wide-area link between
      regions: {east: [coordinator, worker-1], west: [worker-2, worker-3]}
      lan: lan-1g
      wan: {rate: 50mbit, delay: 40ms}
      allow_partial: true

A pair entry has ``between`` (two node names; one of them may be ``worker``: every worker) and a
``profile`` (a preset name, ``none``, an inline profile, a schedule or a trace), or profile keys in
place of ``profile``. Which link a pair takes, most specific first: a pair entry naming both nodes, one
naming ``worker``, the regions' ``lan`` (both in one region) or ``wan`` (in two), then ``default``;
a pair with none of them is not shaped. Both directions of a pair take its profile (each end shapes its
own egress to the other, `harness.links.pairs`).

Checked when the spec loads (`Topology.check_nodes` with the point's worker count): every node name
known (``coordinator``, ``worker``, ``worker-N`` with N <= the workers), a pair of two different
nodes given once, a node in one region at most, ``lan``/``wan`` only with ``regions``. A pair profile
is an htb class: ``qdisc: tbf`` and ``ingress: true`` are refused (both ends' egress shape the pair).
"""

from __future__ import annotations

import re
from typing import Any, Callable, Mapping

from pydantic_core import PydanticCustomError

from harness.spec.base import SpecModel, fail, shown
from harness.spec.links import PROFILE_KEYS, LinkProfile

TOPOLOGY_KEYS = ("pairs", "regions", "lan", "wan", "default", "allow_partial")
EVERY_WORKER = "worker"
_NODE = re.compile(r"^(coordinator|worker|worker-[1-9][0-9]{0,5})$")
MAX_PAIRS = 10_000


class PairEntry(SpecModel):
    """One ``pairs`` entry: its two node names (``worker``: every worker) and profile (None: unshaped)."""

    nodes: tuple[str, str]
    profile: LinkProfile | None = None

    @property
    def wildcard(self) -> bool:
        """Whether one end is ``worker`` (every worker)."""
        return EVERY_WORKER in self.nodes


class Topology(SpecModel):
    """The links of one point by pair of nodes (see the module doc)."""

    pairs: tuple[PairEntry, ...] = ()
    regions: dict[str, tuple[str, ...]] = {}
    lan: LinkProfile | None = None
    wan: LinkProfile | None = None
    default: LinkProfile | None = None

    def link_for(self, a: str, b: str) -> tuple[str, LinkProfile | None]:
        """The link of the pair {`a`, `b`} (node names): ``(name, profile)``, name ``pairs[i]``, ``lan``,
        ``wan``, ``default`` or ``none`` (then the profile is None), most specific first."""
        ends = {a, b}
        for wildcard in (False, True):
            for i, entry in enumerate(self.pairs):
                if entry.wildcard != wildcard:
                    continue
                if not wildcard and set(entry.nodes) == ends:
                    return f"pairs[{i}]", entry.profile
                if wildcard:
                    other = next(n for n in entry.nodes if n != EVERY_WORKER)
                    if other in ends and (ends - {other}).pop().startswith("worker-"):
                        return f"pairs[{i}]", entry.profile
        region = {node: name for name, nodes in self.regions.items() for node in nodes}
        if a in region and b in region:
            return ("lan", self.lan) if region[a] == region[b] else ("wan", self.wan)
        if self.default is not None:
            return "default", self.default
        return "none", None

    def check_nodes(self, num_workers: int) -> tuple[str, str] | None:
        """The first node name beyond a point of `num_workers` workers: ``(path, message)``, with the
        path below the ``link`` value (``pairs[1].between[0]``, ``regions.west[1]``); None when all are
        known."""
        def beyond(name: str) -> str | None:
            if name.startswith("worker-") and int(name.split("-")[1]) > num_workers:
                return f"{name!r} but the point has {num_workers} workers; allowed: coordinator, worker, " \
                       f"worker-1..worker-{num_workers}"
            return None
        for i, entry in enumerate(self.pairs):
            for j, name in enumerate(entry.nodes):
                if (why := beyond(name)) is not None:
                    return f"pairs[{i}].between[{j}]", why
        for region, nodes in self.regions.items():
            for j, name in enumerate(nodes):
                if (why := beyond(name)) is not None:
                    return f"regions.{region}[{j}]", why
        return None

    def to_dict(self) -> dict[str, Any]:
        """The topology as reports record it: pairs (``between``, ``profile``), regions, lan, wan, default."""
        def prof(p: LinkProfile | None) -> dict[str, Any] | None:
            return p.to_dict() if p is not None else None
        return {"pairs": [{"between": list(e.nodes), "profile": prof(e.profile)} for e in self.pairs],
                "regions": {k: list(v) for k, v in self.regions.items()}, "lan": prof(self.lan),
                "wan": prof(self.wan), "default": prof(self.default)}


def is_topology(value: Any) -> bool:
    """Whether a ``link`` mapping gives links by pair (it has ``pairs`` or ``regions``)."""
    return isinstance(value, Mapping) and ("pairs" in value or "regions" in value)


def _node(value: Any, *path: str | int, wildcard: bool = True) -> str:
    if not isinstance(value, str) or not _NODE.match(value) or (value == EVERY_WORKER and not wildcard):
        allowed = "coordinator, worker-N" + (", worker (every worker)" if wildcard else "")
        raise fail(f"unknown node {shown(value)}; allowed: {allowed}", *path)
    return value


def _pair_profile(value: Any, parse_profile: Callable[[Any], LinkProfile | None], *path: str | int) -> LinkProfile | None:
    try:
        profile = parse_profile(value)
    except PydanticCustomError as exc:  # a schedule's own path below the profile
        raise fail(exc.message(), *path, *(exc.context or {}).get("path", ())) from None
    except ValueError as exc:
        raise fail(str(exc), *path) from None
    if profile is not None and profile.root_qdisc != "htb":
        raise fail("a pair's link is an htb class; qdisc: tbf is for whole containers", *path)
    if profile is not None and profile.ingress:
        raise fail("a pair is shaped on both ends' egress already; ingress: true is for whole containers", *path)
    return profile


def _entry(i: int, value: Any, parse_profile: Callable[[Any], LinkProfile | None]) -> PairEntry:
    if not isinstance(value, Mapping) or "between" not in value:
        raise fail(f"{shown(value)}; allowed: a mapping {{between: [coordinator, worker-1], profile: ...}}",
                   "pairs", i)
    between = value["between"]
    if not isinstance(between, list) or len(between) != 2:
        raise fail(f"{shown(between)}; allowed: a list of two node names", "pairs", i, "between")
    nodes = (_node(between[0], "pairs", i, "between", 0), _node(between[1], "pairs", i, "between", 1))
    if nodes[0] == nodes[1]:
        raise fail(f"{nodes[0]!r} twice; a pair is two different nodes", "pairs", i, "between")
    rest = {k: v for k, v in value.items() if k != "between"}
    if "profile" in rest:
        stray = sorted(set(rest) - {"profile"})
        if stray:
            raise fail("give profile or profile keys, not both", "pairs", i, stray[0])
        profile = _pair_profile(rest["profile"], parse_profile, "pairs", i, "profile")
    elif rest:
        profile = _pair_profile(rest, parse_profile, "pairs", i)
    else:
        raise fail(f"no profile; allowed: profile: <preset|none|mapping>, or profile keys ({', '.join(PROFILE_KEYS)})",
                   "pairs", i)
    return PairEntry(nodes=nodes, profile=profile)


def parse_topology(value: Mapping[str, Any], parse_profile: Callable[[Any], LinkProfile | None]) -> Topology:
    """A ``link`` mapping with ``pairs`` or ``regions`` (`is_topology`) -> `Topology`. `parse_profile`
    reads one profile value (a preset name, ``none``, a mapping, a schedule) and raises ValueError.

    Raises:
        PydanticCustomError (`fail`): naming the path below the value (``pairs[1].between[0]``) and
        what is allowed (see the module doc). Node numbers beyond the point are `Topology.check_nodes`'.
    """
    for key in value:
        if key not in TOPOLOGY_KEYS:
            raise fail(f"unknown key beside pairs/regions; allowed: {', '.join(TOPOLOGY_KEYS)}", str(key))
    pairs = value.get("pairs", [])
    if not isinstance(pairs, list) or len(pairs) > MAX_PAIRS:
        raise fail(f"{shown(pairs)}; allowed: a list of at most {MAX_PAIRS} pair entries", "pairs")
    entries = [_entry(i, v, parse_profile) for i, v in enumerate(pairs)]
    seen: dict[frozenset[str], int] = {}
    for i, entry in enumerate(entries):
        key = frozenset(entry.nodes)
        if key in seen:
            raise fail(f"the pair {' and '.join(entry.nodes)} is given twice (also pairs[{seen[key]}])", "pairs", i)
        seen[key] = i
    regions_value = value.get("regions", {})
    if not isinstance(regions_value, Mapping):
        raise fail(f"{shown(regions_value)}; allowed: a mapping of region name to a list of nodes", "regions")
    regions: dict[str, tuple[str, ...]] = {}
    placed: dict[str, str] = {}
    for name, nodes in regions_value.items():
        if not isinstance(nodes, list) or not nodes:
            raise fail(f"{shown(nodes)}; allowed: a non-empty list of node names", "regions", str(name))
        for j, node in enumerate(nodes):
            _node(node, "regions", str(name), j, wildcard=False)
            if node in placed:
                raise fail(f"{node!r} is in region {placed[node]!r} already; a node is in one region",
                           "regions", str(name), j)
            placed[node] = str(name)
        regions[str(name)] = tuple(nodes)
    links: dict[str, LinkProfile | None] = {}
    for key in ("lan", "wan", "default"):
        if key in value:
            if key != "default" and not regions:
                raise fail(f"{key} is the link {'inside' if key == 'lan' else 'between'} regions; give regions too", key)
            links[key] = _pair_profile(value[key], parse_profile, key)
    if regions and "lan" not in links and "wan" not in links:
        raise fail("regions need lan, wan or both (the links inside and between them)", "regions")
    return Topology(pairs=tuple(entries), regions=regions, **links)
