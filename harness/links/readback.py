"""Reading tc's own account of what is in force: the qdiscs and classes of an interface, from
``tc -j -s qdisc show dev X`` and ``tc -j -s class show dev X`` (iproute2's JSON), as one record per
qdisc or class with its rates (bit/s), sizes (bytes), times (ms) and counters (bytes, packets, drops,
overlimits).

A record (the shape the reports have always stored, so reports written before still load and render):

- ``type`` (``qdisc`` | ``class``), ``kind`` (``htb``, ``tbf``, ``netem``, ``pfifo``, ``ingress``,
  ``noqueue``...), ``handle`` (``1:``, ``1:1``), ``parent`` (``root`` or the parent's handle);
- the options read, each only when tc printed it: ``rate_bps``, ``ceil_bps`` (bit/s), ``burst_bytes``,
  ``cburst_bytes`` (bytes), ``latency_ms`` (tbf), ``limit_packets`` (a queue counted in packets),
  ``delay_ms``, ``jitter_ms`` (netem; jitter only when non-zero), ``loss_pct``, ``loss_corr_pct``,
  ``reorder_pct``, ``reorder_corr_pct``, ``reorder_gap``, ``duplicate_pct``, ``duplicate_corr_pct``
  (netem, 0..100; a correlation only when non-zero) and ``loss_gemodel_pct`` ([p, r, 1-h, 1-k]);
- with ``-s``: ``sent_bytes``, ``sent_packets``, ``drops``, ``overlimits``, ``requeues``,
  ``backlog_bytes``, ``backlog_packets``.

Units of iproute2's JSON, read in its source (tc/, lib/json_print.c): rates are **bytes** per second
(``print_color_rate`` prints the raw kernel value in JSON and shifts it to bit/s only for text), sizes
and backlogs bytes, tbf's ``lat`` microseconds (tc's TIME_UNITS_PER_SEC), netem's delay and jitter
seconds and its percentages fractions of 1 (``__print_percent`` in tc/q_netem.c).

Classes came to JSON only in iproute2 6.2 (commit 010a8388, "tc: Add JSON output to tc-class"); the
iproute2 6.1.0 of the node image and of Debian 12 prints ``tc -j class show`` as text. Such text is read
by `parse_class_text`, word by word with `wiiide.units`, into the same records.
"""

from __future__ import annotations

import json
from typing import Any, Iterable, Mapping

from harness.errors import LinkShapingError
from harness.spec.links import ROOT_QDISCS
from wiiide.units import UnitError, parse_rate_bps, parse_size_bytes

TYPES = ("qdisc", "class")


# iproute2 JSON counter key -> record key (tc/tc_util.c print_tcstats2_attr)
_COUNTERS = {"bytes": "sent_bytes", "packets": "sent_packets", "drops": "drops", "overlimits": "overlimits",
             "requeues": "requeues"}
_BACKLOG = {"backlog": "backlog_bytes", "qlen": "backlog_packets"}


# kinds whose ``limit`` is bytes, not packets (bfifo: tc/q_fifo.c print_size); tbf prints no limit
_LIMIT_IN_BYTES = ("bfifo", "tbf")


def show_commands(dev: str) -> dict[str, list[str]]:
    """The read-back commands of one interface: ``{"qdisc": argv, "class": argv}`` (``tc -j -s``)."""
    return {type_: ["tc", "-j", "-s", type_, "show", "dev", dev] for type_ in TYPES}


def _integer(value: Any, key: str, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise LinkShapingError(f"tc -j {where}: {key} is {value!r}, expected a whole number as iproute2 prints it")
    return value


def _number(value: Any, key: str, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise LinkShapingError(f"tc -j {where}: {key} is {value!r}, expected a number as iproute2 prints it")
    return float(value)


# netem's JSON objects (tc/q_netem.c netem_print_opt) -> (their key, our key, factor) for the value and
# for its companion, recorded only when non-zero: seconds -> ms, fractions of 1 -> percent
_NETEM = {"delay": (("delay", "delay_ms", 1000), ("jitter", "jitter_ms", 1000)),
          "loss-random": (("loss", "loss_pct", 100), ("correlation", "loss_corr_pct", 100)),
          "reorder": (("reorder", "reorder_pct", 100), ("correlation", "reorder_corr_pct", 100)),
          "duplicate": (("duplicate", "duplicate_pct", 100), ("correlation", "duplicate_corr_pct", 100))}
GEMODEL_JSON_KEYS = ("p", "r", "1-h", "1-k")  # netem_print_opt's "loss-gemodel" object, fractions of 1


def _netem_options(options: Mapping[str, Any], where: str) -> dict[str, Any]:
    """netem's delay object (seconds), loss-random, reorder, duplicate and loss-gemodel objects (fractions)
    and gap -> ms, percent and packets."""
    out: dict[str, Any] = {}
    for name, ((key, ours, factor), (companion, companion_ours, companion_factor)) in _NETEM.items():
        values = options.get(name)
        if isinstance(values, Mapping):
            out[ours] = round(_number(values.get(key), f"{name}.{key}", where) * factor, 6)
            extra = round(_number(values.get(companion, 0), f"{name}.{companion}", where) * companion_factor, 6)
            if extra:
                out[companion_ours] = extra
    gemodel = options.get("loss-gemodel")
    if isinstance(gemodel, Mapping):
        out["loss_gemodel_pct"] = [round(_number(gemodel.get(k), f"loss-gemodel.{k}", where) * 100, 6)
                                   for k in GEMODEL_JSON_KEYS]
    if "reorder_pct" in out and options.get("gap"):
        out["reorder_gap"] = _integer(options["gap"], "gap", where)
    return out


def _options(kind: str, options: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The options of one qdisc or class, in the record's units (see the module docstring)."""
    out: dict[str, Any] = {}
    for key in ("rate", "ceil"):
        if key in options:
            out[f"{key}_bps"] = _integer(options[key], key, where) * 8  # bytes/s in JSON
    for key in ("burst", "cburst"):
        if key in options:
            out[f"{key}_bytes"] = _integer(options[key], key, where)
    if "lat" in options:
        out["latency_ms"] = _integer(options["lat"], "lat", where) / 1000  # microseconds in JSON
    if "limit" in options and kind not in _LIMIT_IN_BYTES:
        out["limit_packets"] = _integer(options["limit"], "limit", where)
    if kind == "netem":
        out.update(_netem_options(options, where))
    return out


def _counters(stats: Mapping[str, Any], where: str) -> dict[str, int]:
    out = {}
    if "bytes" in stats:
        out.update({ours: _integer(stats.get(theirs, 0), theirs, where) for theirs, ours in _COUNTERS.items()})
    if "backlog" in stats:
        out.update({ours: _integer(stats.get(theirs, 0), theirs, where) for theirs, ours in _BACKLOG.items()})
    return out


def _record(type_: str, entry: Mapping[str, Any], dev: str) -> dict[str, Any]:
    """One JSON object of ``tc -j -s qdisc|class show`` -> one record.

    qdiscs (tc/tc_qdisc.c print_qdisc) have ``kind``, their options under ``options`` and the counters
    at the top; classes (tc/tc_class.c print_class) have ``class`` for the kind, their options at the
    top and the counters under ``stats``.
    """
    kind = entry.get("kind" if type_ == "qdisc" else "class")
    handle = entry.get("handle")
    where = f"{type_} show dev {dev}"
    if not isinstance(kind, str) or not isinstance(handle, str):
        raise LinkShapingError(f"tc -j {where}: an entry without kind or handle: {dict(entry)!r}")
    parent = "root" if entry.get("root") else entry.get("parent")
    options = entry.get("options", {}) if type_ == "qdisc" else entry
    stats = entry if type_ == "qdisc" else entry.get("stats", {})
    where = f"{where}, {type_} {kind} {handle}"
    return {"type": type_, "kind": kind, "handle": handle, "parent": parent,
            **_options(kind, options, where), **_counters(stats, where)}


def parse_tc_json(text: str, type_: str, dev: str = "?") -> list[dict[str, Any]]:
    """Parse what ``tc -j -s qdisc show dev X`` (`type_` ``qdisc``) or ``tc -j -s class show dev X``
    (``class``) printed into one record per qdisc or class, in tc's order (see the module docstring for
    the record's keys and units). Empty output (no class) is an empty list.

    Raises:
        LinkShapingError: `type_` is neither ``qdisc`` nor ``class``; the text is not a JSON list of
        objects; an object has no kind or handle; a rate, size or counter is not a number.
    """
    if type_ not in TYPES:
        raise LinkShapingError(f"cannot read tc's {type_!r}: allowed: {' | '.join(TYPES)}")
    if not text.strip():
        return []
    try:
        entries = json.loads(text)
    except json.JSONDecodeError as exc:
        raise LinkShapingError(f"tc -j {type_} show dev {dev} printed no JSON ({exc}): {text[:200]!r}") from None
    if not isinstance(entries, list) or not all(isinstance(e, Mapping) for e in entries):
        raise LinkShapingError(f"tc -j {type_} show dev {dev} printed {type(entries).__name__}, not a list of objects")
    return [_record(type_, entry, dev) for entry in entries]


def parse_class_text(text: str, dev: str = "?") -> list[dict[str, Any]]:
    """Parse ``tc -s class show dev X`` as iproute2 < 6.2 prints it (also with ``-j``) into the records
    `parse_tc_json` makes of the JSON of a newer tc: one per ``class`` line, its ``rate``/``ceil`` (SI bit
    rates, ``100Mbit``) and ``burst``/``cburst`` (sizes, ``50000b``; K = 1024) read with `wiiide.units`,
    the ``Sent ... (dropped D, overlimits O requeues R)`` and ``backlog Bb Pp`` lines as counters. Other
    lines (htb's ``lended:``, ``tokens:``) are not recorded.

    Raises:
        LinkShapingError: a class line without kind, handle and parent, or a value that is not a rate,
        a size or a count.
    """
    records: list[dict[str, Any]] = []
    for line in text.splitlines():
        words = line.replace("(", " ").replace(")", " ").replace(",", " ").split()
        try:
            if words[:1] == ["class"]:
                if len(words) < 4 or (words[3] != "root" and len(words) < 5):
                    raise LinkShapingError(f"tc class show dev {dev}: a class line without kind, handle and "
                                           f"parent: {line.strip()!r}")
                after = dict(zip(words, words[1:]))  # each word -> the word after it
                record: dict[str, Any] = {"type": "class", "kind": words[1], "handle": words[2],
                                          "parent": "root" if words[3] == "root" else words[4]}
                for key in ("rate", "ceil"):
                    if key in after:
                        record[f"{key}_bps"] = parse_rate_bps(after[key], key)
                for key in ("burst", "cburst"):
                    if key in after:
                        record[f"{key}_bytes"] = parse_size_bytes(after[key], key)
                records.append(record)
            elif words[:1] == ["Sent"] and records:
                after = dict(zip(words, words[1:]))
                records[-1].update(sent_bytes=int(words[1]), sent_packets=int(words[3]), drops=int(after["dropped"]),
                                   overlimits=int(after["overlimits"]), requeues=int(after["requeues"]))
            elif words[:1] == ["backlog"] and records and len(words) >= 3:
                records[-1].update(backlog_bytes=parse_size_bytes(words[1], "backlog"),
                                   backlog_packets=int(words[2].removesuffix("p")))
        except (UnitError, ValueError, KeyError, IndexError) as exc:
            raise LinkShapingError(f"tc class show dev {dev}: cannot read {line.strip()!r}: {exc}") from None
    return records


def parse_classes(text: str, dev: str = "?") -> list[dict[str, Any]]:
    """``tc -j -s class show dev X``'s output -> records: JSON from iproute2 >= 6.2 (`parse_tc_json`),
    text from iproute2 6.1 and older, which ignore ``-j`` for classes (`parse_class_text`).

    Raises:
        LinkShapingError: as `parse_tc_json` or `parse_class_text`.
    """
    stripped = text.lstrip()
    if not stripped or stripped.startswith("["):
        return parse_tc_json(text, "class", dev)
    return parse_class_text(text, dev)


def rate_in_force_bps(entries: Iterable[Mapping[str, Any]]) -> int | None:
    """The lowest rate (bit/s) of a rate-limiting qdisc or class (htb, tbf) among read-back records;
    None when nothing limits the rate."""
    rates = [e["rate_bps"] for e in entries if e.get("rate_bps") and e.get("kind") in ROOT_QDISCS]
    return min(rates) if rates else None


def burst_in_force_bytes(entries: Iterable[Mapping[str, Any]]) -> float | None:
    """The smallest token bucket (``burst`` or ``cburst``, bytes) of a rate-limiting qdisc or class (htb,
    tbf) among read-back records: what leaves at the wire's speed after the link idled; None when none
    was read."""
    buckets = [e[key] for e in entries if e.get("kind") in ROOT_QDISCS
               for key in ("burst_bytes", "cburst_bytes") if isinstance(e.get(key), (int, float))]
    return min(buckets) if buckets else None
