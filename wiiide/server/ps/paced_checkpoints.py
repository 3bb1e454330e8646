"""Checkpoints of paced shards (`wiiide.server.ps.paced`): the coordinator's side of the cut.

The shards write the files (`wiiide.server.ps.checkpoints.ShardCheckpointer`: a partition's copy at checkpoint
step N, the shard's file once all its partitions reached N, before the pull that answers the push). What
makes the files of step N one state of the run depends on the pacing:

- **rounds** (adaptive batches, s = 0): step N is round N on every partition, as in the barrier; the
  multiples of ``checkpoint_every_steps`` need nothing here, and ``checkpoint_every_s`` announces a round
  ahead of every shard (`wiiide.server.ps.checkpoints.announce_step`);
- **async and a staleness bound** (the shards apply each push as it arrives): a partition's step counts
  the pushes it applied, in the order they reached its shard, so two partitions at step N may hold
  different pushes. The coordinator drains at the cut instead: it hands out no task past N (a multiple
  of ``checkpoint_every_steps``, or the step ``checkpoint_every_s`` announced) until every task handed
  out is reported. Then the N tasks handed out since the run began are exactly the N pushes every
  partition applied, each partition's N-th update is its last before the cut, and every shard's file of
  step N holds the same run state. The price is one pause per checkpoint: the workers that finish
  their task wait for the slowest one's (``drain_s`` in the record).

The coordinator's shard adds the handout to its file (`handout_meta`): the tasks handed out and each
worker's SSP clock (tasks reported) at the cut. A restarted coordinator starts every worker's clock from
it (`restored_clocks`), so the bound goes on where it was: every worker starts from the restored
parameters with a fresh copy (staleness 0) and the clocks' gap is the one the bound allowed at the cut.
"""

from __future__ import annotations

import time
from typing import Any

from wiiide.server.checkpoint import CheckpointSchedule
from wiiide.metrics import summarize
from wiiide.server.ps.checkpoints import announce_step

HANDOUT_KEY = "paced_handout"  # the run metadata key of the coordinator's shard file


class PacedCheckpoints:
    """When a paced run's coordinator may hand out a task, and the time-triggered announcements.

    Args:
        cfg: checkpoint_every_steps, checkpoint_every_s (both 0: nothing is held back).
        start_step: the step the run starts at (a restored checkpoint's, else 0).
        on_arrival: True under async / a staleness bound (the cut drains), False in rounds.
        client: the coordinator's `wiiide.server.ps.client.ShardClient` (announcements), or None.
    """

    def __init__(self, cfg: Any, start_step: int, on_arrival: bool, client: Any) -> None:
        self.every_steps, self.on_arrival, self.client = cfg.checkpoint_every_steps, on_arrival, client
        self.timer = CheckpointSchedule(0, cfg.checkpoint_every_s if client is not None else 0.0, start_step)
        self.next_multiple = self._multiple_after(start_step)
        self.announced: int | None = None
        self._held_since: float | None = None
        self._drain_s: list[float] = []
        self.cuts = 0

    def _multiple_after(self, step: int) -> int | None:
        return (step // self.every_steps + 1) * self.every_steps if self.every_steps else None

    def limit(self) -> int | None:
        """Async / SSP: the most tasks (counted from the run's start) handed out before the next cut
        drains; None: no limit (rounds, or checkpoints off)."""
        if not self.on_arrival:
            return None
        cuts = [s for s in (self.next_multiple, self.announced) if s is not None]
        return min(cuts) if cuts else None

    def held(self) -> None:
        """The handout reached `limit`: the drain starts (its seconds are recorded)."""
        if self._held_since is None:
            self._held_since = time.perf_counter()

    def after_update(self, updates: int, handed: int, rounds_handed: int) -> None:
        """After an update: `updates` applied since the run began, `handed` tasks handed out (async / SSP),
        `rounds_handed` the rounds handed out to every worker (rounds). Moves past a drained cut, and
        announces a time-triggered one when checkpoint_every_s passed."""
        if self.on_arrival and updates == handed and updates in (self.next_multiple, self.announced):
            self.cuts += 1
            if self._held_since is not None:
                self._drain_s.append(time.perf_counter() - self._held_since)
            self._held_since = None
            if updates == self.next_multiple:
                self.next_multiple = self._multiple_after(updates)
            if updates == self.announced:
                self.announced = None
        if not self.timer.enabled or self.announced is not None or not self.timer.due(updates, time.monotonic()):
            return
        step = announce_step(handed if self.on_arrival else rounds_handed)
        self.client.announce_checkpoint(step)
        self.timer.mark(updates, time.monotonic())
        if self.on_arrival:
            self.announced = step

    def record(self) -> dict:
        """The pace record's ``checkpoint_cut``: how the cut is made, the drains done and their seconds."""
        return {"cut": "drain" if self.on_arrival else "round", "cuts_drained": self.cuts,
                "drain_s": summarize(self._drain_s) if self._drain_s else None}


def handout_meta(handed: int, given: dict[int, int]) -> dict:
    """The coordinator shard's run metadata at a drained cut: the tasks handed out since the run began and
    each worker's SSP clock (its tasks, all reported at the cut), keyed by rank as a string (JSON)."""
    return {HANDOUT_KEY: {"tasks_handed_out": handed, "ssp_clocks": {str(r): c for r, c in sorted(given.items())}}}


def restored_clocks(run: dict, ranks: list[int], step: int) -> dict[int, int] | None:
    """The SSP clocks `handout_meta` saved in a restored file's run metadata `run` for the workers `ranks`,
    when they sum to the restored `step` (every task of the cut reported); None otherwise (then every
    clock starts at 0, as on the central pace server)."""
    saved = (run.get(HANDOUT_KEY) or {}).get("ssp_clocks") if isinstance(run.get(HANDOUT_KEY), dict) else None
    if not isinstance(saved, dict):
        return None
    clocks = {r: saved.get(str(r)) for r in ranks}
    if any(type(c) is not int or c < 0 for c in clocks.values()) or sum(clocks.values()) != step:  # noqa: E721
        return None
    return clocks
