"""Held-out evaluation of a sharded run: the coordinator assembles snapshots of the shards' parameters.

Under ``ps_shards`` > 1 the parameters live on the shards; for ``eval_every_s`` (held-out curve, time
to target, ``stop_at_target``) a thread on the coordinator pulls every partition from its shard
(`wiiide.server.ps.client.ShardClient.pull_final`) each time the `wiiide.training.evaluation.BackgroundEvaluator` is
due and hands the assembled flat vector to it. The barrier never waits for a pull. A snapshot is the
partitions as they are when their shards answer: each at the barrier's step or ahead of it by the
steps in flight (`wiiide.server.ps.session.HANDOUT_AHEAD`); the point is recorded with the barrier's step and
samples at the time of the pull. The final evaluation uses the exact final parameters.
"""

from __future__ import annotations

import threading
from typing import Callable, Sequence

import torch

from wiiide.server.ps.partition import Partition

POLL_S = 0.05  # how often the thread checks whether a snapshot is due


class ShardSnapshots:
    """A daemon thread that feeds `evaluator` with snapshots pulled through `client` (the coordinator's
    `ShardClient`). `progress()` returns (step, samples) of the barrier. Use `start`, then `stop` before
    the client's own final pull. `error` holds the first failure (the thread then ends; the run goes on
    and its failure, if any, surfaces on the barrier)."""

    def __init__(self, evaluator, client, partitions: Sequence[Partition], numel: int,
                 progress: Callable[[], tuple[int, int]]) -> None:
        self.evaluator, self.client, self.partitions, self.numel = evaluator, client, list(partitions), numel
        self.progress = progress
        self.pulls = 0
        self.error: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="shard snapshots", daemon=True)

    def start(self) -> "ShardSnapshots":
        self._thread.start()
        return self

    def stop(self) -> None:
        """End the thread after the pull in flight, if any."""
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        while not self._stop.wait(POLL_S):
            if not self.evaluator.due():
                continue
            step, samples = self.progress()
            try:
                values = self.client.pull_final(self.partitions, self.numel)
            except Exception as exc:  # ShardFailed, ProtocolError: no more snapshots
                self.error = f"{type(exc).__name__}: {exc}"
                return
            self.evaluator.submit(step, samples, torch.from_numpy(values))
            self.pulls += 1
