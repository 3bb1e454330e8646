"""Reading tc's own account of what is in force: the qdiscs and classes of an interface, with their
rates (bit/s), sizes (bytes), times (ms) and counters (bytes, packets, drops, overlimits).
"""

from __future__ import annotations

import re
from typing import Any, Iterable, Mapping

from harness.spec.links import ROOT_QDISCS

_HEADER_RE = re.compile(r"^(qdisc|class)\s+(\S+)\s+(\S+)\s+(root|parent\s+\S+)(.*)$")


_SENT_RE = re.compile(r"Sent (\d+) bytes (\d+) pkt \(dropped (\d+), overlimits (\d+) requeues (\d+)\)")


_BACKLOG_RE = re.compile(r"backlog (\S+?)b? (\d+)p")


_TC_RATE_RE = re.compile(r"^(\d+(?:\.\d+)?)([KMGT]?)bit$")


_TC_SIZE_RE = re.compile(r"^(\d+(?:\.\d+)?)([KMG]?)b$")


_TC_TIME_RE = re.compile(r"^(\d+(?:\.\d+)?)(us|ms|s)$")


_SI = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}  # tc prints rates in SI units
_TIME_MS = {"us": 1e-3, "ms": 1.0, "s": 1000.0}
_BINARY = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3}


def tc_rate_bps(text: str) -> int | None:
    """tc's printed rate (``100Mbit``, ``1.5Gbit``, ``800bit``; SI) -> bit/s; None if not a rate."""
    match = _TC_RATE_RE.match(text)
    return int(round(float(match.group(1)) * _SI[match.group(2).upper()])) if match else None


def tc_size_bytes(text: str) -> int | None:
    """tc's printed size (``1600b``, ``16Kb``, ``2Mb``; binary: K = 1024) -> bytes."""
    match = _TC_SIZE_RE.match(text)
    return int(round(float(match.group(1)) * _BINARY[match.group(2)])) if match else None


def tc_time_ms(text: str) -> float | None:
    match = _TC_TIME_RE.match(text)
    return float(match.group(1)) * _TIME_MS[match.group(2)] if match else None


def _options(kind: str, text: str) -> dict[str, Any]:
    """The options we read from a header line's tail (rates, burst, netem's delay and loss)."""
    tokens = text.split()
    out: dict[str, Any] = {}

    def after(i: int) -> str:
        return tokens[i + 1] if i + 1 < len(tokens) else ""

    for i, token in enumerate(tokens):
        if token in ("rate", "ceil") and tc_rate_bps(after(i)) is not None:
            out[f"{token}_bps"] = tc_rate_bps(after(i))
        elif token in ("burst", "cburst") and tc_size_bytes(after(i)) is not None:
            out[f"{token}_bytes"] = tc_size_bytes(after(i))
        elif token == "lat" and tc_time_ms(after(i)) is not None:
            out["latency_ms"] = tc_time_ms(after(i))
        elif token == "limit" and kind != "tbf":
            value = after(i).rstrip("p")
            if value.isdigit():
                out["limit_packets"] = int(value)
        elif token == "delay" and tc_time_ms(after(i)) is not None:
            out["delay_ms"] = tc_time_ms(after(i))
            jitter = tc_time_ms(tokens[i + 2]) if i + 2 < len(tokens) else None
            if jitter is not None:
                out["jitter_ms"] = jitter
        elif token == "loss" and after(i).endswith("%"):
            out["loss_pct"] = float(after(i)[:-1])
            if i + 2 < len(tokens) and tokens[i + 2].endswith("%"):
                out["loss_corr_pct"] = float(tokens[i + 2][:-1])
    return out


def parse_tc_show(text: str) -> list[dict[str, Any]]:
    """Parse ``tc -s qdisc show dev X`` (and ``tc -s class show dev X``) into one dict per qdisc/class.

    Each dict: ``type`` (qdisc|class), ``kind``, ``handle``, ``parent`` ("root" or a handle), the
    options read (``rate_bps``, ``ceil_bps``, ``burst_bytes``, ``limit_packets``, ``delay_ms``,
    ``jitter_ms``, ``loss_pct``, ``loss_corr_pct``, ``latency_ms``) and, with ``-s``, the counters
    ``sent_bytes``, ``sent_packets``, ``drops``, ``overlimits``, ``requeues``, ``backlog_bytes``,
    ``backlog_packets``. Lines it does not know (htb's tokens, lended) are skipped.
    """
    entries: list[dict[str, Any]] = []
    for line in text.splitlines():
        header = _HEADER_RE.match(line.strip())
        if header:
            type_, kind, handle, where, rest = header.groups()
            parent = "root" if where == "root" else where.split()[1]
            entries.append({"type": type_, "kind": kind, "handle": handle, "parent": parent, **_options(kind, rest)})
            continue
        if not entries:
            continue
        sent = _SENT_RE.search(line)
        if sent:
            keys = ("sent_bytes", "sent_packets", "drops", "overlimits", "requeues")
            entries[-1].update(dict(zip(keys, map(int, sent.groups()))))
            continue
        backlog = _BACKLOG_RE.search(line)
        if backlog and "backlog_bytes" not in entries[-1]:
            entries[-1]["backlog_bytes"] = tc_size_bytes(backlog.group(1) + "b")
            entries[-1]["backlog_packets"] = int(backlog.group(2))
    return entries


def rate_in_force_bps(entries: Iterable[Mapping[str, Any]]) -> int | None:
    """The lowest rate of a rate-limiting qdisc or class in a readback (None when nothing limits)."""
    rates = [e["rate_bps"] for e in entries if e.get("rate_bps") and e.get("kind") in ROOT_QDISCS]
    return min(rates) if rates else None


def read_commands(dev: str) -> list[list[str]]:
    return [["tc", "-s", "qdisc", "show", "dev", dev], ["tc", "-s", "class", "show", "dev", dev]]
