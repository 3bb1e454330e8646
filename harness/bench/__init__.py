"""Benchmarks that write JSON: `wire` (bench-wire: codecs, frames and compression policies on paced links).
"""

from __future__ import annotations

from typing import Any


def sigterm_as_interrupt(signum: int, frame: Any) -> None:
    """SIGTERM handler of the benchmarks: raise KeyboardInterrupt, so that a benchmark stopped by `timeout`
    or `kill` unwinds as on Ctrl-C (its ``finally`` removes its containers and networks)."""
    raise KeyboardInterrupt(f"signal {signum}")
