"""The run side of links by pair (`harness.links.pairs`) and of links that change while training
(`harness.run.link_timeline`), as `harness.run.shaping.ClusterConditions` uses them.

- `node_ips`: each container's node name and address on its network (from the Engine API), which the
  pair filters match on;
- `shape_pairs`: run a node's pair commands in its container and read back its classes and filters
  into the report's ``links.pairs`` (one record per direction, ``"<node>-><peer>"``);
- `update_pair_counters`: refresh those records' rates and byte counts from a counter read;
- `read_pair_fallback`: where the fallback applies a pair's impairments, its own counts per pair (the
  chain's ``fallback_counters`` and the pair's ``delay_line`` stats);
- `probe_pair_rtts`: a TCP round-trip probe per pair with a delay, beside the round trip asked;
- `timeline_targets`: the trees of a container that change on a timeline (its own profile, or a
  pair class's), each with the list its change records go to.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping

from harness.errors import LinkShapingError
from harness.links import rtt
from harness.links.delayline import runs_in_background
from harness.links.pairs import PairPlan, filter_show_command, node_name, pair_commands, pair_records, parse_filters
from harness.links.plan import ShapingPlan
from harness.links.tc import DEFAULT_DEV
from harness.run.link_timeline import TimelineTarget
from harness.run.tc_exec import read_back, read_delay_line_stats, read_fallback_counters
from harness.spec.timeline import TimedProfile

def container_ip(container) -> str | None:
    """A container's IPv4 address on its (first) network, from the Engine API's attrs; None if none."""
    networks = ((getattr(container, "attrs", None) or {}).get("NetworkSettings") or {}).get("Networks") or {}
    for network in networks.values():
        address = (network or {}).get("IPAddress")
        if address:
            return str(address)
    return None


def node_ips(containers: list, identity) -> dict[str, str]:
    """``{node name: IPv4 address}`` of `containers` (docker SDK containers, reloaded here);
    `identity(container)` gives its (role, worker index). Containers without an address are left out."""
    out = {}
    for c in containers:
        c.reload()  # the address comes with the start; attrs from before it have none
        address = container_ip(c)
        if address:
            out[node_name(*identity(c))] = address
    return out


def shape_pairs(runner, plan: PairPlan, ips: Mapping[str, str], record: dict[str, Any],
                pairs: dict[str, Any]) -> None:
    """Apply `plan` (one node's egress classes) in its container with `runner`, read back its classes
    and filters, and store the per-pair records in `pairs` (the report's ``links.pairs``); the
    container's `record` gets the commands, ``pair_classes`` and the plan's unsupported parts.

    Raises:
        LinkShapingError: a command failed, a peer has no address, or the read-back failed.
    """
    commands = pair_commands(plan, ips)
    for argv in commands:
        if runs_in_background(argv):  # a pair's delay line (harness.links.delayline)
            runner.start(argv)
        else:
            runner.run(argv)
    classes = read_back(runner, [DEFAULT_DEV])[DEFAULT_DEV]  # read again if an exec's output was lost
    filters = parse_filters(runner.run(filter_show_command()), DEFAULT_DEV) if commands else {}
    record["commands"] = [*record.get("commands", []), *commands]
    record["unsupported"] = [*record.get("unsupported", []), *plan.unsupported]
    record["pair_classes"] = {cls.classid: cls.peer for cls in plan.classes}
    record["summary"] = "; ".join(f"to {cls.peer}: {cls.to_dict()['summary']}" for cls in plan.classes) or "not shaped"
    pairs.update(pair_records(plan, ips, classes, filters))
    read_pair_fallback(runner, plan, pairs)


def read_pair_fallback(runner, plan: PairPlan, pairs: dict[str, Any]) -> None:
    """Store in `plan`'s pair records (in `pairs`) the fallback's own counts where it applies a pair's
    keys: ``fallback_counters`` (`harness.run.tc_exec.read_fallback_counters` of the pair's chains) and
    ``delay_line`` (the pair's delay line's stats). A read that fails (the container has exited) leaves
    the last one. Raises nothing."""
    for cls in plan.classes:
        record = pairs.get(f"{plan.node}->{cls.peer}")
        chain, dup_chain = cls.fallback_chains
        if record is None or (chain is None and dup_chain is None):
            continue
        try:
            record["fallback_counters"] = read_fallback_counters(runner, chain, dup_chain)
            if cls.delay_line:
                record["delay_line"] = read_delay_line_stats(runner, cls.minor)
        except LinkShapingError:
            continue


def update_pair_counters(pairs: dict[str, Any], node: str, counters: Mapping[str, list[dict[str, Any]]]) -> None:
    """Refresh the rate and counters of `node`'s pair records in `pairs` from a counter read
    (`harness.run.tc_exec.read_back`'s ``{dev: records}``). Raises nothing."""
    by_handle = {r.get("handle"): r for r in counters.get(DEFAULT_DEV, []) if r.get("type") == "class"}
    for key, record in pairs.items():
        if key.startswith(f"{node}->") and record.get("classid") in by_handle:
            seen = by_handle[record["classid"]]
            record.update({k: seen.get(k) for k in ("rate_bps", "sent_bytes", "sent_packets", "drops")})


def timeline_targets(name: str, runner, plan: ShapingPlan, pair_plan: PairPlan | None,
                     record: dict[str, Any], pairs: dict[str, Any]) -> list[TimelineTarget]:
    """The targets of one container whose profile changes while training: its own tree (the record's
    ``timeline_changes``) and each pair class with a changing profile (the pair record's
    ``timeline_changes``). Raises nothing."""
    targets = []
    if isinstance(plan.applied, TimedProfile) and plan.applied.timeline:
        record["timeline_changes"] = []
        targets.append(TimelineTarget(name, runner, plan.applied, record["timeline_changes"]))
    for cls in pair_plan.classes if pair_plan is not None else ():
        if isinstance(cls.applied, TimedProfile) and cls.applied.timeline:
            pair = pairs.setdefault(f"{pair_plan.node}->{cls.peer}", {})
            pair["timeline_changes"] = []
            targets.append(TimelineTarget(f"{name}->{cls.peer}", runner, cls.applied, pair["timeline_changes"],
                                          classid=cls.classid, netem_handle=cls.netem_handle))
    return targets



MAX_PAIR_PROBES = 8  # round-trip probes per point (about 2 s each): the first pairs with a delay, in node order


def probe_pair_rtts(by_node: Mapping[str, Any], plans: Iterable[PairPlan], ips: Mapping[str, str],
                    pairs: dict[str, Any], progress: Callable[[str], None]) -> None:
    """The measured read-back of the delay per pair (`harness.links.rtt`): for each pair of nodes whose
    links ask for a round trip (the two directions' one-way delays), TCP round trips from the second
    node to the first, recorded as ``rtt_probe`` (median and p99 beside ``asked_rtt_ms``) in both
    directions' records of `pairs`; at most `MAX_PAIR_PROBES` pairs. `by_node`: node name -> container.
    A probe that fails is recorded with its ``error``. Raises nothing."""
    applied = {(plan.node, cls.peer): cls.applied for plan in plans for cls in plan.classes}
    done: set[frozenset[str]] = set()
    for (a, b) in sorted(applied):
        ends = frozenset((a, b))
        if ends in done or len(done) >= MAX_PAIR_PROBES or a not in by_node or b not in by_node:
            continue
        asked = rtt.asked_rtt_ms(applied.get((a, b)), applied.get((b, a)))
        if not asked:
            continue
        done.add(ends)
        record: dict[str, Any] = {"between": [b, a], "asked_rtt_ms": asked, "message_bytes": rtt.MESSAGE_BYTES}
        try:
            samples = rtt.measure_rtt(by_node[a], by_node[b], ips.get(a, a), rtt.probe_count(asked))
            record.update(rtt.summarize(samples, asked))
            progress(f"    link round trip {b} -> {a}: median {record['median_rtt_ms']:.3f} ms, "
                     f"p99 {record['p99_rtt_ms']:.3f} ms (asked {asked:g} ms)")
        except (RuntimeError, ValueError) as exc:
            record["error"] = str(exc)
            progress(f"    link round trip {b} -> {a} NOT MEASURED: {exc}")
        for key in (f"{a}->{b}", f"{b}->{a}"):
            if key in pairs:
                pairs[key]["rtt_probe"] = record
