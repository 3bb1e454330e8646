"""A sender thread's loop over an outbox (`drain_outbox`, used on both ends of a shard link: a shard's
pulls out, a client's pushes out) and the step a push or pull frame carries (`frame_step`)."""

from __future__ import annotations

import queue
import time
from typing import Any, Callable

from wiiide.node import Connection
from wiiide.ps.feedback import DENSE_KIND, LOSSY_KIND
from wiiide.wire.messages import Frame


def drain_outbox(outbox: "queue.Queue", conn: Connection, to_frame: Callable[[Any], Any],
                 on_error: Callable[[Exception], None],
                 on_sent: Callable[[Frame, float], None] | None = None) -> None:
    """A sender thread's loop: send `to_frame(item)` for each item of `outbox` until a None; the first
    error (OSError, or a codec's in `to_frame`) goes to `on_error` and ends the loop. `on_sent` is told
    each frame sent and the thread's CPU seconds its send took (`time.thread_time`, `to_frame` not in it)."""
    while True:
        item = outbox.get()
        if item is None:
            return
        try:
            frame = to_frame(item)
            cpu0 = time.thread_time()
            conn.send([frame])
            if on_sent is not None:
                on_sent(frame, time.thread_time() - cpu0)
        except Exception as exc:
            on_error(exc)
            return


def frame_step(frame: Frame) -> Any:
    """The step a push or pull `frame` carries (its header's ``meta.step``, as `encode_message` built
    it); None for any other frame, which `NodeMetrics.add_stage_cpu` then leaves out."""
    if frame.kind not in (DENSE_KIND, LOSSY_KIND) or frame.header is None:
        return None
    return (frame.header.get("meta") or {}).get("step")
