"""The one parser of units in WIIIIIDE and its harness: sizes, bit rates, times and percentages.

- Sizes are binary (IEC): ``k``, ``KB`` and ``KiB`` all mean 1,024 bytes, ``M``/``MB``/``MiB``
  1,048,576 and ``G``/``GB``/``GiB`` 1,073,741,824, as Docker reads ``mem_limit`` and as socket buffer
  sizes are usually written (``8MiB`` = ``8m``). A bare number is bytes.
- Bit rates are decimal (SI), as tc reads them: ``100mbit`` = 100,000,000 bit/s. A bare number is
  refused (ambiguous), and so is ``bps``, which tc reads as *bytes* per second.
- Times: ``us``, ``ms``, ``s``; a bare number is refused (netem and our specs mix ms and s).
- Percentages: ``1``, ``0.5``, ``"1%"``.

Every parser raises `UnitError` (a `ValueError`, so pydantic validators and config checks turn it into
their own error with the field path) whose message names the field, the value and what is allowed.
"""

from __future__ import annotations

import re
from typing import Any

KIB = 1024
MIB = 1024 * KIB
GIB = 1024 * MIB

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(b|k|kb|kib|m|mb|mib|g|gb|gib|t|tb|tib)?\s*$", re.IGNORECASE)
_SIZE_FACTOR = {"": 1, "b": 1, "k": KIB, "kb": KIB, "kib": KIB, "m": MIB, "mb": MIB, "mib": MIB,
                "g": GIB, "gb": GIB, "gib": GIB, "t": 1024 * GIB, "tb": 1024 * GIB, "tib": 1024 * GIB}
_RATE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(bit|bps)(/s)?\s*$", re.IGNORECASE)
_SI = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_TIME_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(us|ms|s)\s*$", re.IGNORECASE)
_TIME_MS = {"us": 1e-3, "ms": 1.0, "s": 1000.0}
_PCT_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*%?\s*$")
_MAX_TEXT = 64  # longer strings are refused before any regular expression sees them


class UnitError(ValueError):
    """A value that is not a size, rate, time or percentage; the message says what is allowed."""


def _text(value: Any, field: str) -> str:
    text = str(value)
    if len(text) > _MAX_TEXT:
        raise UnitError(f"{field}: a value of {len(text)} characters is not a quantity")
    return text


def parse_size_bytes(value: Any, field: str = "size") -> int:
    """``4096``, ``"256k"``, ``"8MiB"``, ``"1.5g"`` -> bytes (int; IEC: k = 1,024).

    Raises:
        UnitError: a bool, a negative or non-integral byte count, or anything not of that form.
    """
    if isinstance(value, bool):
        raise UnitError(f"{field}: {value!r} is not a size: write e.g. 4096, 256KiB, 8MiB")
    if isinstance(value, int):
        if value < 0:
            raise UnitError(f"{field}: {value!r} is negative")
        return value
    if isinstance(value, float):
        if not value.is_integer() or value < 0:
            raise UnitError(f"{field}: {value!r} is not a whole number of bytes")
        return int(value)
    match = _SIZE_RE.match(_text(value, field))
    if not match:
        raise UnitError(f"{field}: {value!r} is not a size: write e.g. 4096, 256KiB, 8MiB, 1GiB (k = 1024)")
    number, unit = match.groups()
    nbytes = float(number) * _SIZE_FACTOR[(unit or "").lower()]
    if not nbytes.is_integer():
        raise UnitError(f"{field}: {value!r} is not a whole number of bytes")
    return int(nbytes)


def parse_rate_bps(value: Any, field: str = "rate") -> int:
    """``"100mbit"``, ``"1Gbit/s"``, ``"500kbit"`` -> bit/s (int; SI: k = 1,000, as tc reads them).

    Raises:
        UnitError: a bare number (ambiguous), tc's byte units (``mbps`` means MB/s to tc) or anything else.
    """
    if isinstance(value, bool) or isinstance(value, (int, float)):
        raise UnitError(f"{field}: {value!r} needs a unit: e.g. 100mbit, 1gbit, 500kbit (bit/s, k = 1000)")
    match = _RATE_RE.match(_text(value, field))
    if not match:
        raise UnitError(f"{field}: {value!r} is not a rate: write e.g. 100mbit, 1gbit, 500kbit (bit/s, k = 1000)")
    number, prefix, unit, _ = match.groups()
    if unit.lower() == "bps":
        raise UnitError(f"{field}: {value!r} is ambiguous (tc reads 'bps' as bytes per second); "
                        f"write bits: e.g. {number}{prefix}bit")
    return int(round(float(number) * _SI[prefix.lower()]))


def parse_time_ms(value: Any, field: str = "time") -> float:
    """``"20ms"``, ``"500us"``, ``"1.5s"`` -> milliseconds (float).

    Raises:
        UnitError: a bare number or a unit other than us, ms, s.
    """
    if isinstance(value, bool) or isinstance(value, (int, float)):
        raise UnitError(f"{field}: {value!r} needs a unit: e.g. 20ms, 500us, 1s")
    match = _TIME_RE.match(_text(value, field))
    if not match:
        raise UnitError(f"{field}: {value!r} is not a time: write e.g. 20ms, 500us, 1s")
    return float(match.group(1)) * _TIME_MS[match.group(2).lower()]


def parse_time_s(value: Any, field: str = "time") -> float:
    """Like `parse_time_ms`, in seconds (float). Raises `UnitError` as it does."""
    return parse_time_ms(value, field) / 1000.0


def parse_pct(value: Any, field: str = "percentage") -> float:
    """``1``, ``0.5``, ``"1%"`` -> percent (float, not checked against 0..100: callers bound it).

    Raises:
        UnitError: a bool or anything not a number with an optional ``%``.
    """
    if isinstance(value, bool):
        raise UnitError(f"{field}: {value!r} is not a percentage")
    if isinstance(value, (int, float)):
        return float(value)
    match = _PCT_RE.match(_text(value, field))
    if not match:
        raise UnitError(f"{field}: {value!r} is not a percentage: write e.g. 1% or 0.5")
    return float(match.group(1))


def format_rate(rate_bps: float | None) -> str:
    """100_000_000 -> ``"100Mbit"`` (as tc prints rates); None -> ``"-"``."""
    if rate_bps is None:
        return "-"
    for prefix, factor in (("T", 10**12), ("G", 10**9), ("M", 10**6), ("K", 10**3)):
        if rate_bps >= factor:
            return f"{rate_bps / factor:g}{prefix}bit"
    return f"{rate_bps:g}bit"


def format_size(nbytes: float | None) -> str:
    """1_048_576 -> ``"1MiB"``, 1536 -> ``"1.5KiB"`` (IEC, up to three significant digits); None -> ``"-"``."""
    if nbytes is None:
        return "-"
    for unit, factor in (("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if abs(nbytes) >= factor:
            return f"{nbytes / factor:.3g}{unit}"
    return f"{nbytes:g}B"
