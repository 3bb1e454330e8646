"""Progress files: each rank of a run says, about once a second, which phase it is in and how many
steps it has made, so whoever drives the run (the harness) can tell a rank that is training from one
that is stuck in a collective, without waiting for the run's timeout.

A file is ``<metrics_dir>/progress/<node_id>.json`` (the node id with anything outside
``[A-Za-z0-9_.-]`` replaced by ``_``), written atomically::

    {"node_id": "local-worker-2", "role": "worker", "rank": 3, "phase": "train", "step": 120,
     "pid": 4242, "wall_time_unix_s": 1795000000.0}

Phases: ``setup`` (rendezvous done, data and model being built, the wrapper's first collectives),
``train`` (in the step loop), ``finish`` (after the last step: evaluation, the metrics file).
The reader compares files between reads (the step or phase changed: progress), by its own clock: the
nodes' clocks (other containers) never enter the judgement. Written by the ddp/fsdp engines
(`wiiide.engines.torch_dist`); JSON only, no pickle.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Callable

from wiiide.metrics import write_json_atomic

PROGRESS_DIR = "progress"
PHASES = ("setup", "train", "finish")
BEAT_INTERVAL_S = 1.0  # at most one write per second while the phase stays the same


def progress_path(metrics_dir: str | Path, node_id: str) -> Path:
    """``<metrics_dir>/progress/<node_id, sanitised>.json``."""
    return Path(metrics_dir) / PROGRESS_DIR / f"{re.sub(r'[^A-Za-z0-9_.-]', '_', node_id) or 'node'}.json"


class ProgressBeat:
    """Writes one node's progress file, at most every `interval_s` seconds unless the phase changes.

    Args:
        metrics_dir: the node's metrics folder (``cfg.metrics_dir``); '' disables the beat.
        node_id, role: the node's id and role, written into the file.
        interval_s: the least seconds between two writes of the same phase.
        clock: a monotonic clock (seconds), replaceable in tests.

    A write that fails (a full disk, a folder removed) is given up silently after the first failure:
    progress files serve the harness's watchdog, never the training.
    """

    def __init__(self, metrics_dir: str | Path, node_id: str, role: str, interval_s: float = BEAT_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.path = progress_path(metrics_dir, node_id) if metrics_dir else None
        self.node_id, self.role, self.interval_s, self.clock = node_id, role, interval_s, clock
        self.rank: int | None = None
        self._phase: str | None = None
        self._last_s = float("-inf")

    def beat(self, step: int, phase: str = "train") -> bool:
        """Record `step` (steps done) in `phase` (one of `PHASES`); True when the file was written.

        Raises:
            ValueError: an unknown phase.
        """
        if phase not in PHASES:
            raise ValueError(f"progress phase {phase!r}: one of {PHASES}")
        if self.path is None:
            return False
        now_s = self.clock()
        if phase == self._phase and now_s - self._last_s < self.interval_s:
            return False
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_json_atomic(self.path, {"node_id": self.node_id, "role": self.role, "rank": self.rank,
                                          "phase": phase, "step": int(step), "pid": os.getpid(),
                                          "wall_time_unix_s": time.time()})
        except OSError:
            self.path = None  # give up: the run must not suffer for its watchdog
            return False
        self._phase, self._last_s = phase, now_s
        return True
