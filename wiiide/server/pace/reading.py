"""What the loops at the workers' pace read from their workers: which connections have a frame waiting
(one thread waits on every worker's socket at once, `selectors`), and the compute seconds a worker
reports with its push or ``step_done``. Used by the central pace server (`wiiide.server.pace.server`) and the
sharded servers' paced handout (`wiiide.server.ps.paced`).
"""

from __future__ import annotations

import math
import selectors
from typing import Any

from wiiide.errors import ProtocolError


def ready_connections(selector: selectors.BaseSelector, timeout_s: float) -> list[tuple[Any, Any]]:
    """The (worker, connection) pairs registered with `selector` (as its keys' data) that have a frame to
    read: first those whose connection already holds bytes read from its socket (TLS reads ahead:
    `Connection.buffered_nbytes`; `select` cannot see them), then those `select` finds readable within
    `timeout_s` (0 when some are buffered)."""
    buffered = [key.data for key in selector.get_map().values() if key.data[1].buffered_nbytes()]
    seen = {id(conn) for _, conn in buffered}
    return buffered + [key.data for key, _ in selector.select(timeout=0 if buffered else timeout_s)
                       if id(key.data[1]) not in seen]


def compute_seconds(meta: dict[str, Any]) -> float | None:
    """A push's ``compute_s`` (the worker's wall seconds for the task, from the batch's arrival to the
    push; a CPU-throttled worker's stalls included), or None when the worker sent none.

    Raises:
        ProtocolError: ``compute_s`` is not a finite number >= 0.
    """
    value = meta.get("compute_s")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ProtocolError(f"'compute_s' must be a finite number >= 0, got {value!r:.40}")
    return float(value)
