"""Spans of a node's steps, for a timeline of the run (``trace_steps``; ``wiiide-lab timeline``).

With ``trace_steps`` N > 0 a node keeps, for the N steps after the warm-up (steps ``warmup_steps`` to
``warmup_steps + N - 1``), a span for everything it does that the metrics already time:

- ``send`` / ``receive`` of every message with a step in its meta (pushes and pulls of each partition,
  gradients and parameters of the central server, ``step_done``), with its kind, bytes on the wire and the
  peer; a receive's span includes the wait for the message (a barrier's wait shows as one);
- ``compute``: a worker's forward and backward of a batch;
- ``update``: a shard's (or the central server's) optimizer step on what it received;
- ``step``: the node's whole step, as its Training Summary times it.

Times are wall-clock Unix seconds (`time.time`): the containers of one host share the host's clock, so the
nodes' spans line up on one timeline. Spans beyond `MAX_SPANS` are counted, not kept. The node's metrics
carry them as ``trace`` (`StepTrace.to_dict`); `harness.present.timeline` writes them in Chrome's Trace Event
Format.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

MAX_SPANS = 50_000  # about 3 MB of metrics JSON at most


class StepTrace:
    """The spans of steps ``first_step`` .. ``first_step + steps - 1`` (``steps`` >= 1); thread-safe."""

    def __init__(self, first_step: int, steps: int, clock: Callable[[], float] = time.time) -> None:
        if steps < 1:
            raise ValueError(f"a trace needs steps >= 1, got {steps}")
        self.first_step, self.steps = first_step, steps
        self._clock = clock
        self._lock = threading.Lock()
        self._spans: list[list[Any]] = []
        self.dropped = 0

    def wants(self, step: Any) -> bool:
        """Whether spans of `step` (an int; anything else: no) are kept."""
        return type(step) is int and self.first_step <= step < self.first_step + self.steps  # noqa: E721 (bool)

    def add(self, name: str, cat: str, step: Any, dur_s: float, end_unix_s: float | None = None,
            **args: Any) -> None:
        """Keep a span `name` of category `cat` (send, receive, compute, update, step) of `step` that lasted
        `dur_s` seconds and ended at `end_unix_s` (default: now), with JSON-ready `args` (bytes, peer, ...);
        a span of a step outside the window is not kept."""
        if not self.wants(step):
            return
        end = self._clock() if end_unix_s is None else end_unix_s
        span = [name, cat, step, round(end - max(dur_s, 0.0), 6), round(max(dur_s, 0.0), 6),
                threading.current_thread().name, args]
        with self._lock:
            if len(self._spans) < MAX_SPANS:
                self._spans.append(span)
            else:
                self.dropped += 1

    def to_dict(self) -> dict[str, Any]:
        """``{"first_step", "steps", "clock": "unix_s", "fields": [...], "spans": [[...], ...], "dropped"}``:
        each span a list in the order of ``fields``."""
        with self._lock:
            spans = list(self._spans)
        return {"first_step": self.first_step, "steps": self.steps, "clock": "unix_s",
                "fields": ["name", "cat", "step", "start_unix_s", "dur_s", "thread", "args"],
                "spans": spans, "dropped": self.dropped}


def message_step(header_meta: Any) -> Any:
    """The ``step`` of a message's meta (a dict), or None."""
    return header_meta.get("step") if isinstance(header_meta, dict) else None
