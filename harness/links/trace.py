"""Mahimahi packet-delivery traces, read and turned into a rate timeline for tc.

A Mahimahi trace (Netravali et al., "Mahimahi: Accurate Record-and-Replay for HTTP", USENIX ATC 2015;
the format of ``mm-link``) is a text file with one line per *delivery opportunity*: a whole number of
milliseconds since the trace's start, in non-decreasing order. Each opportunity lets one packet of up
to `PACKET_BYTES` (1500) bytes through; several lines with the same millisecond are several packets
in that millisecond. When the trace ends, ``mm-link`` starts it again from the top, so its period is
its last timestamp.

tc shapes with a rate, not with opportunities: `rate_steps` counts the opportunities in consecutive
windows (100 ms by default) and gives each window the rate ``count x 1500 x 8 / window`` in bit/s,
joining neighbours of equal rate. A window with no opportunity (an outage) gets `MIN_RATE_BPS`, the
lowest rate a profile may have, since an htb class or a tbf needs a rate above zero.

`parse_trace` refuses a trace that is empty, has a line that is not a whole number, a negative
timestamp, one smaller than the line before, more than `MAX_OPPORTUNITIES` lines, a file over
`MAX_TRACE_BYTES`, a timestamp past `MAX_TRACE_MS`, or a window faster than `MAX_RATE_BPS`.
Nothing here runs a command.
"""

from __future__ import annotations

import math
from pathlib import Path

from harness.spec.links import MAX_RATE_BPS, MIN_RATE_BPS

PACKET_BYTES = 1500  # one delivery opportunity carries one MTU-sized packet (mm-link)
MAX_TRACE_BYTES = 16 * 1024 * 1024  # a trace file's size at most (the field's cellular traces: ~1-3 MB)
MAX_OPPORTUNITIES = 2_000_000  # lines at most
MAX_TRACE_MS = 3_600_000  # an hour: a timestamp past it is refused
DEFAULT_WINDOW_MS = 100.0


class TraceError(ValueError):
    """A trace that cannot be used: the message names the line (1-based) and what is wrong."""


def parse_trace(text: str, name: str = "trace") -> list[int]:
    """The delivery opportunities of a Mahimahi trace, in ms, as written (non-decreasing).

    `text` is the file's content; blank lines and surrounding spaces are ignored.

    Raises:
        TraceError: ``<name>: line N: ...`` for a line that is not a whole number of ms, negative,
        smaller than the one before or past `MAX_TRACE_MS`; ``<name>: ...`` for an empty trace, one
        of more than `MAX_OPPORTUNITIES` lines or one whose last timestamp is 0 (no period).
    """
    if len(text) > MAX_TRACE_BYTES:
        raise TraceError(f"{name}: {len(text)} bytes; allowed: at most {MAX_TRACE_BYTES} bytes")
    opportunities: list[int] = []
    previous = 0
    for number, line in enumerate(text.splitlines(), start=1):
        word = line.strip()
        if not word:
            continue
        if not (word.isdigit() or (word.startswith("-") and word[1:].isdigit())) or len(word) > 12:
            raise TraceError(f"{name}: line {number}: {word[:40]!r} is not a whole number of milliseconds")
        ms = int(word)
        if ms < 0:
            raise TraceError(f"{name}: line {number}: {ms} ms is negative")
        if ms < previous:
            raise TraceError(f"{name}: line {number}: {ms} ms comes after {previous} ms; a trace is non-decreasing")
        if ms > MAX_TRACE_MS:
            raise TraceError(f"{name}: line {number}: {ms} ms; allowed: at most {MAX_TRACE_MS} ms (an hour)")
        if len(opportunities) >= MAX_OPPORTUNITIES:
            raise TraceError(f"{name}: more than {MAX_OPPORTUNITIES} delivery opportunities")
        opportunities.append(ms)
        previous = ms
    if not opportunities:
        raise TraceError(f"{name}: empty: a trace needs at least one line (a delivery opportunity in ms)")
    if opportunities[-1] == 0:
        raise TraceError(f"{name}: its last timestamp is 0 ms, so it has no period to repeat")
    return opportunities


def read_trace(path: Path) -> list[int]:
    """`parse_trace` of the file at `path`.

    Raises:
        TraceError: as `parse_trace`, or the file is missing, unreadable, not UTF-8 text, or over
        `MAX_TRACE_BYTES` (checked before reading it).
    """
    try:
        size = path.stat().st_size
        if size > MAX_TRACE_BYTES:
            raise TraceError(f"{path}: {size} bytes; allowed: at most {MAX_TRACE_BYTES} bytes")
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TraceError(f"{path}: cannot read the trace: {exc}") from None
    return parse_trace(text, str(path))


def period_ms(opportunities: list[int]) -> int:
    """How long the trace lasts before ``mm-link`` repeats it: its last timestamp, in ms."""
    return opportunities[-1]


def rate_steps(opportunities: list[int], window_ms: float = DEFAULT_WINDOW_MS) -> list[tuple[float, int]]:
    """The trace as a rate timeline: ``[(at_s, rate_bps), ...]`` from 0 s, one entry per change.

    Window k covers (k x window, (k+1) x window] ms of one period (ms 0 counts in the first) (`period_ms`; the last window may be
    shorter, and its rate is taken over its own length); its rate is its opportunities x `PACKET_BYTES`
    x 8 bits over its length, at least `MIN_RATE_BPS`. Neighbouring windows of the same rate are one
    entry. `window_ms` > 0.

    Raises:
        TraceError: a window faster than `MAX_RATE_BPS` (100 Gbit/s), or `window_ms` <= 0.
    """
    if not window_ms > 0:
        raise TraceError(f"window {window_ms:g} ms; allowed: > 0")
    period = period_ms(opportunities)
    n_windows = max(1, math.ceil(period / window_ms))
    counts = [0] * n_windows
    for ms in opportunities:
        counts[min(max(0, math.ceil(ms / window_ms) - 1), n_windows - 1)] += 1
    steps: list[tuple[float, int]] = []
    for k, count in enumerate(counts):
        length_ms = min(window_ms, period - k * window_ms) if k == n_windows - 1 else window_ms
        rate = round(count * PACKET_BYTES * 8 * 1000 / max(length_ms, 1e-9))
        if rate > MAX_RATE_BPS:
            raise TraceError(f"window at {k * window_ms / 1000:g} s: {count} opportunities is {rate} bit/s; "
                             f"allowed: at most {MAX_RATE_BPS} bit/s")
        rate = max(rate, MIN_RATE_BPS)
        if not steps or steps[-1][1] != rate:
            steps.append((round(k * window_ms / 1000, 6), rate))
    return steps


def mean_rate_bps(opportunities: list[int]) -> float:
    """The trace's mean rate over one period: opportunities x 1500 x 8 bits / period (bit/s)."""
    return len(opportunities) * PACKET_BYTES * 8 * 1000 / period_ms(opportunities)
