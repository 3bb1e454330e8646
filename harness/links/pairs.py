"""Links between pairs of nodes on each container's egress: the plan for one node of a `Topology`
(`harness.spec.pairs`), the pure builders of its tc commands, and the per-pair read-back.

Each node shapes its own egress to every peer whose pair has a link, so both directions of a pair are
shaped, one at each end (no ifb needed: the other end's egress is this end's ingress). On ``eth0``:

    tc qdisc replace dev eth0 root handle 1: htb                      # unclassified traffic: unshaped
    tc class replace dev eth0 parent 1: classid 1:12 htb rate R ceil R burst B cburst B quantum Q
    tc qdisc replace dev eth0 parent 1:12 handle 112: netem ...       # where the kernel has netem
    tc filter add dev eth0 parent 1: protocol ip prio 1 u32 match ip dst 172.18.0.4/32 flowid 1:12

one class per peer, numbered by the peer (`class_minor`: 1:10 the coordinator, 1:11 worker-1, ...;
tc reads the minor as hex), its netem child (handle 1xx:) for a delay or loss, and a u32 filter on the
peer's address. An htb without ``default`` sends what no filter matches (other destinations, ARP)
straight out, unshaped (tc-htb(8), "default"). A pair profile without a rate gets
`NOMINAL_LINE_RATE_BPS` as its class's rate (netem does the work). Sizes (burst, quantum) are
`harness.links.tc`'s.

Where the kernel has no netem, a pair's delay, loss, reorder and duplicate go through the fallback
(`harness.links.fallback`) matched on the peer's source address on arrival: each end impairs what it
receives from the peer (``iptables ... -i eth0 -s PEER/32``), in a chain, a queue and a delay line of
the pair's own (`harness.links.fallback.pair_chain`: chain ``WIIIIIDE-LINK-<minor>``, queue <minor>),
so a round trip sees the same two one-way terms as netem on both ends' egress. The class keeps the rate.

A pair link's bytes are its class's counters (``tc -s class show``), read at every counter read;
`parse_filters` reads ``tc -j filter show`` back to confirm each peer's filter points at its class.
Nothing here runs a command.
"""

from __future__ import annotations

import ipaddress
import json
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from harness.errors import LinkShapingError
from harness.links.fallback import (
    NETEM,
    UNSUPPORTED,
    choose_mechanisms,
    fallback_chains,
    missing_parts,
    pair_chain,
    rule_commands,
    rule_reset_commands,
)
from harness.links.plan import Capabilities, describe
from harness.links.schedule import check_timeline, htb_class_args
from harness.links.tc import DEFAULT_DEV, NOMINAL_LINE_RATE_BPS, netem_args
from harness.spec.links import LinkProfile
from harness.spec.pairs import Topology
from harness.spec.timeline import TimedProfile

FIRST_MINOR = 0x10
NETEM_MAJOR_BASE = 0x100
FILTER_PRIO = "1"
_DST_OFFSET = 16  # u32's offset of the IPv4 destination address (tc-u32(8), "match ip dst")


def node_name(role: str, index: int | None) -> str:
    """``coordinator`` or ``worker-N`` for a container's (role, worker index)."""
    return "coordinator" if role == "coordinator" else f"worker-{index}"


def node_names(num_workers: int) -> list[str]:
    """The nodes of a point: ``coordinator``, ``worker-1`` .. ``worker-<num_workers>``."""
    return ["coordinator", *(f"worker-{i}" for i in range(1, num_workers + 1))]


def class_minor(peer: str) -> int:
    """The minor of the class of traffic to `peer`: `FIRST_MINOR` (0x10) + 0 for the coordinator, + N for
    worker-N. Raises ValueError for another name."""
    if peer == "coordinator":
        return FIRST_MINOR
    if peer.startswith("worker-") and peer[7:].isdigit():
        return FIRST_MINOR + int(peer[7:])
    raise ValueError(f"not a node name: {peer!r}")


@dataclass(frozen=True)
class PairClass:
    """The class of one node's traffic to one `peer`: its `link` (``pairs[i]``, ``lan``, ``wan``,
    ``default``), the profile asked and the part applied, its `classid` and netem `netem_handle`."""

    peer: str
    link: str
    requested: LinkProfile
    applied: LinkProfile
    classid: str
    netem_handle: str
    netem: bool
    mechanisms: Mapping[str, str] = field(default_factory=dict)

    @property
    def minor(self) -> int:
        """The class's minor (``1:11`` -> 0x11), the fallback's queue number for the pair."""
        return int(self.classid.split(":")[1], 16)

    @property
    def fallback_chains(self) -> tuple[str | None, str | None]:
        """The fallback's chains this class installs (`harness.links.fallback.fallback_chains`)."""
        chain, dup_chain, _ = pair_chain(self.minor)
        return fallback_chains(dict(self.mechanisms), chain, dup_chain)

    @property
    def delay_line(self) -> bool:
        """Whether the pair has a delay line of its own (a key applied by it)."""
        return "delay-line" in self.mechanisms.values()

    def to_dict(self) -> dict[str, Any]:
        """The report's record of the class (without counters): ``mechanisms`` says what applies each
        impairment key (``netem``, or the fallback's mechanisms)."""
        return {"peer": self.peer, "link": self.link, "classid": self.classid,
                "requested": self.requested.to_dict(), "applied_profile": self.applied.to_dict(),
                "summary": describe(self.applied), "mechanisms": dict(self.mechanisms)}


@dataclass(frozen=True)
class PairPlan:
    """What one node's egress gets: a class per shaped peer, and what cannot be applied (with why)."""

    node: str
    classes: tuple[PairClass, ...]
    unsupported: tuple[str, ...] = field(default=())


def _applied(node: str, peer: str, profile: LinkProfile, caps: Capabilities, allow_partial: bool,
             unsupported: list[str]) -> tuple[LinkProfile | None, dict[str, str]]:
    """The part of `profile` this kernel applies on the pair's class (None: nothing), and the mechanism
    of each impairment key it applies."""
    where = f"pair {node}->{peer}"
    if not caps.htb:
        raise LinkShapingError(f"{where}: pair links are htb classes and this kernel has no htb")
    if isinstance(profile, TimedProfile):
        profile, missing = check_timeline(profile, caps.netem, allow_partial)
        unsupported += [f"{where}: {m}" for m in missing]
    mechanisms = choose_mechanisms(profile, caps.netem, caps.fallback)
    if profile.needs_netem and not caps.netem:
        missing, changes = missing_parts(profile, mechanisms)
        if missing:
            asked = ", ".join(missing)
            if not allow_partial:
                raise LinkShapingError(f"{where}: link profile {profile.name!r} asks for {asked} but this kernel has "
                                       f"no netem (nor a fallback for it); set allow_partial: true to apply the rest")
            unsupported.append(f"{where}: {asked}: this kernel has no netem")
            mechanisms = {key: how for key, how in mechanisms.items() if how != UNSUPPORTED}
            profile = profile.replace(**changes)
            if not profile.needs_netem and not mechanisms:
                return profile.without_netem(), {}
    return profile, mechanisms


def plan_pairs(topology: Topology, node: str, num_workers: int, caps: Capabilities,
               allow_partial: bool = False) -> PairPlan:
    """The classes of `node`'s egress in a point of `num_workers` workers: one per peer whose pair has
    a link (`Topology.link_for`), with what this kernel applies of it.

    Raises:
        LinkShapingError: the kernel has no htb, or a pair asks for an impairment (or a schedule of one)
        that neither netem nor a fallback applies here and `allow_partial` is false.
    """
    classes, unsupported = [], []
    for peer in node_names(num_workers):
        if peer == node:
            continue
        link, profile = topology.link_for(node, peer)
        if profile is None:
            continue
        applied, mechanisms = _applied(node, peer, profile, caps, allow_partial, unsupported)
        if applied is None:
            continue
        minor = class_minor(peer)
        classes.append(PairClass(peer, link, profile, applied, f"1:{minor:x}", f"{NETEM_MAJOR_BASE + minor:x}:",
                                 netem=applied.needs_netem and caps.netem, mechanisms=mechanisms))
    return PairPlan(node, tuple(classes), tuple(unsupported))


def pair_commands(plan: PairPlan, peer_ips: Mapping[str, str], dev: str = DEFAULT_DEV) -> list[list[str]]:
    """The tc argv lists of `plan` on `dev` (see the module doc), given each peer's IPv4 address.
    Empty when the plan has no class.

    Raises:
        LinkShapingError: a peer of the plan has no address in `peer_ips`, or not an IPv4 one.
    """
    if not plan.classes:
        return []
    commands = [["tc", "qdisc", "replace", "dev", dev, "root", "handle", "1:", "htb"]]
    for cls in plan.classes:
        ip = peer_ips.get(cls.peer)
        try:
            address = ipaddress.IPv4Address(ip or "")
        except ValueError:
            raise LinkShapingError(f"pair {plan.node}->{cls.peer}: no IPv4 address for {cls.peer} ({ip!r})") from None
        rate = cls.applied.rate_bps or NOMINAL_LINE_RATE_BPS
        commands.append(["tc", "class", "replace", "dev", dev, "parent", "1:", "classid", cls.classid,
                         *htb_class_args(rate)])
        if cls.netem:
            commands.append(["tc", "qdisc", "replace", "dev", dev, "parent", cls.classid, "handle", cls.netem_handle,
                             "netem", *netem_args(cls.applied)])
        commands.append(["tc", "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", FILTER_PRIO,
                         "u32", "match", "ip", "dst", f"{address}/32", "flowid", cls.classid])
    for cls in plan.classes:  # after the tree: the fallback's rules on what arrives from each peer
        fallback = {key: how for key, how in cls.mechanisms.items() if how != NETEM}
        if fallback:
            chain, dup_chain, queue = pair_chain(cls.minor)
            commands += rule_commands(cls.applied, fallback, dev, queue, str(peer_ips[cls.peer]), chain, dup_chain)
    return commands


def pair_reset_commands(plan: PairPlan, peer_ips: Mapping[str, str], dev: str = DEFAULT_DEV) -> list[list[str]]:
    """Undo the fallback's rules and delay lines of `plan` (`harness.links.fallback.rule_reset_commands`
    per peer; the tc tree goes with ``tc qdisc del dev eth0 root``); each fails harmlessly when there is
    nothing to remove. Raises nothing."""
    commands = []
    for cls in plan.classes:
        if any(how != NETEM for how in cls.mechanisms.values()) and cls.peer in peer_ips:
            chain, dup_chain, queue = pair_chain(cls.minor)
            commands += rule_reset_commands(dev, queue, str(peer_ips[cls.peer]), chain, dup_chain)
    return commands


def filter_show_command(dev: str = DEFAULT_DEV) -> list[str]:
    """``tc -j -s filter show dev X``: the filters' read-back."""
    return ["tc", "-j", "-s", "filter", "show", "dev", dev]


def parse_filters(text: str, dev: str = "?") -> dict[str, str]:
    """``tc -j filter show``'s u32 filters -> ``{flowid: destination IPv4}`` (a match of a whole
    address at offset 16, as ``match ip dst A/32`` writes it). Entries without a flowid (the hash
    tables tc lists first) are skipped.

    Raises:
        LinkShapingError: the text is not JSON, or a match's value is not 8 hex digits.
    """
    try:
        entries = json.loads(text) if text.strip() else []
    except json.JSONDecodeError as exc:
        raise LinkShapingError(f"tc -j filter show dev {dev}: not JSON: {exc}") from None
    found: dict[str, str] = {}
    for entry in entries if isinstance(entries, list) else []:
        options = entry.get("options") if isinstance(entry, dict) else None
        if not isinstance(options, dict) or "flowid" not in options or not isinstance(options.get("match"), dict):
            continue
        match = options["match"]
        if match.get("off") != _DST_OFFSET or match.get("mask") != "ffffffff":
            continue
        try:
            found[str(options["flowid"])] = str(ipaddress.IPv4Address(int(str(match.get("value")), 16)))
        except ValueError:
            raise LinkShapingError(f"tc -j filter show dev {dev}: match value {match.get('value')!r} "
                                   f"is not an IPv4 address in hex") from None
    return found


def pair_records(plan: PairPlan, peer_ips: Mapping[str, str], records: Iterable[Mapping[str, Any]],
                 filters: Mapping[str, str] | None = None) -> dict[str, dict[str, Any]]:
    """The report's per-pair records of `plan`'s node, ``{"<node>-><peer>": {...}}``: the class's plan
    (`PairClass.to_dict`), the peer's address, the rate and counters tc reports for the class among
    `records` (`harness.links.readback`'s, of ``dev``): ``rate_bps``, ``sent_bytes``, ``sent_packets``,
    ``drops``; and, when `filters` (`parse_filters`) is given, ``filter_ok``: the peer's filter points at
    the class. A class tc does not list has None counters. Raises nothing."""
    by_handle = {r.get("handle"): r for r in records if r.get("type") == "class"}
    out = {}
    for cls in plan.classes:
        seen = by_handle.get(cls.classid, {})
        record = {**cls.to_dict(), "peer_ip": peer_ips.get(cls.peer),
                  **{key: seen.get(key) for key in ("rate_bps", "sent_bytes", "sent_packets", "drops")}}
        if filters is not None:
            record["filter_ok"] = filters.get(cls.classid) == peer_ips.get(cls.peer)
        out[f"{plan.node}->{cls.peer}"] = record
    return out
