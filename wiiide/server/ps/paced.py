"""Sharded training at the workers' own pace: the coordinator's SSP clock and batch handout.

With ``ps_shards`` > 1 and ``staleness_bound`` != 0 or ``adaptive_batch`` on (`wiiide.server.pace.server.uses_pace`),
`wiiide.server.ps.session` runs this loop in place of its step barrier. The shard is the unit, as in ps-lite and
BytePS: the shards hold the parameters and apply the pushes (`wiiide.server.ps.shard`: with s >= 1 or async each
push as it arrives, scaled by its staleness, and the partition pulled back by the pushing worker alone; in
rounds, s = 0, the mean of every worker's push, weighted by samples with adaptive batches), while this
node keeps what is not bulk:

- **the clock** (`wiiide.server.pace.staleness.SSPClock`): a worker's clock counts its ``step_done`` (each one
  after its pushes were applied and its pulls were in). The coordinator hands a worker task ``j`` (its
  ``j``-th batch, 0-based) only while ``j - slowest clock <= s`` (Ho et al. 2013: a worker at clock ``c``
  starts only while the slowest is at ``c - s`` or later), so the rule holds when the worker starts it,
  however early the batch arrived. A worker holds at most `TASKS_AHEAD` + 1 batches (one computing, one
  waiting), so its next batch is there when its pulls are in, as with the barrier's ``HANDOUT_AHEAD``.
  In rounds the shards keep the step, and the handout runs `TASKS_AHEAD` ahead as the barrier does;
- **the batch sizes** (`wiiide.server.pace.adaptive.AdaptiveBatch`, with ``adaptive_batch``): from each worker's
  ``compute_s``, under a bound also from the clocks; in rounds one split per round for every worker.
  With local SGD (``local_steps`` H > 1) a task is H batches (`wiiide.server.ps.local_sgd.round_rows`) and
  its push a model delta, which the shards apply as the worker's share of the mean
  (`wiiide.server.ps.shard_pacing`);
- **the pace record** (`wiiide.server.pace.record.PaceRecord`): per-worker pushes and samples, the staleness of
  every applied push (the largest the shards reported over the push's partitions: updates of the
  partition since the worker's copy of it), the clock gap, the batch sizes, the tasks whose every pull
  the worker's copy served (``ssp_cache``: its ``step_done`` counts them, ``cached``), in the
  coordinator's metrics as the central pace server records them, so the report reads the same;
- **the checkpoints' cut** (`wiiide.server.ps.paced_checkpoints`): under async and a bound the handout stops at a
  checkpoint step until every task is reported, so every shard's file holds the same pushes; a restored
  run starts at the checkpoint's step with the clocks saved at the cut.

One thread waits on every worker's connection at once (`selectors`, as `wiiide.server.pace.server` does). A worker
lost, silent for ``io_timeout_s`` or misbehaving ends this incarnation (NodeFailure), as at the barrier:
the coordinator goes on over the survivors (`wiiide.server.ps.membership`; under async and a bound from
the surviving shards and the newest copies, `wiiide.server.ps.paced_recovery`). A worker coming back drains
the handout, and the next incarnation readmits it.
"""

from __future__ import annotations

import selectors
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from wiiide.training.data import BatchSampler, Dataset
from wiiide.errors import ProtocolError
from wiiide.training.evaluation import stop_at_target
from wiiide.wire.node import EXIT_PEER_LOST, NodeFailure
from wiiide.server.pace.adaptive import AdaptiveBatch
from wiiide.server.pace.reading import compute_seconds, ready_connections
from wiiide.server.pace.record import PaceRecord
from wiiide.server.pace.staleness import SSPClock
from wiiide.server.ps.local_sgd import round_rows
from wiiide.server.ps.paced_checkpoints import PacedCheckpoints, handout_meta, restored_clocks
from wiiide.server.ps.plan import PS_FAILED, batch_frame

TASKS_AHEAD = 1  # batches a worker may hold beyond the one it computes (the barrier's HANDOUT_AHEAD)
POLL_S = 0.2  # how often the loop looks at the clock, the shard and silent workers when no frame arrives
MAX_STALENESS = 10**9  # a step_done's staleness above this is refused as malformed


@dataclass
class _Task:
    step: int  # the worker's task index: its clock when it starts it; in rounds, the round
    samples: int
    sent_at: float  # time.perf_counter()


@dataclass
class _Done:
    """One worker's applied push: its samples, mean loss, staleness and compute seconds."""

    rank: int
    samples: int
    loss: float
    staleness: int
    compute_s: float | None
    cached: int  # its pulls the shards answered with the copy it held (ssp_cache)


class PacedHandout:
    """The coordinator's side of a paced sharded run (module docstring).

    Args:
        coord: the `wiiide.server.coordinator.Coordinator` (cfg, metrics, log, policy, drop).
        data: the training set (batches of samples for workers without its fingerprint).
        workers: the joined workers; handout: rank -> ``indices`` or ``samples``.
        shard: the coordinator's own `wiiide.server.ps.shard.ShardServer` (its ``failure`` ends the run).
        sampler: the batch stream (`wiiide.training.data.BatchSampler`); start: ``time.perf_counter()`` at the start.
        evaluator: the started background evaluator, or None.
        client: the coordinator's `wiiide.server.ps.client.ShardClient` (checkpoint_every_s announcements), or None.
        start_step: the step a restored run starts at (updates applied; in rounds, the round).
        members: the run's `wiiide.server.ps.membership.Membership` (a worker coming back drains the handout;
            the first update after a recovery closes its record), or None.
        partitions: how many partitions the plan cut (a ``step_done``'s ``cached`` counts up to it).
    """

    def __init__(self, coord, data: Dataset, workers: list, handout: dict[int, str], shard: Any,
                 sampler: BatchSampler, start: float, evaluator: Any, client: Any = None, start_step: int = 0,
                 members: Any = None, partitions: int = 0) -> None:
        cfg = coord.cfg
        self.members, self.partitions = members, partitions
        self.coord, self.cfg, self.data, self.workers, self.handout = coord, cfg, data, workers, handout
        self.shard, self.sampler, self.start, self.evaluator = shard, sampler, start, evaluator
        self.clock = SSPClock(cfg.staleness_bound)
        self.rounds = cfg.staleness_bound == 0
        self.limit = TASKS_AHEAD if self.rounds else self.clock.bound  # None: async
        self.adaptive = (AdaptiveBatch(cfg.num_workers * sampler.batch_size, cfg.adaptive_smoothing,
                                       clock_gain=cfg.adaptive_clock_gain) if cfg.adaptive_batch else None)
        self.record = PaceRecord()
        self.tasks: dict[int, deque[_Task]] = {w.rank: deque() for w in workers}
        self.round_sizes: dict[int, dict[int, int]] = {}  # rounds: round -> every worker's batch size
        self.round_done: dict[int, list[_Done]] = {}  # rounds: round -> the pushes reported so far
        earlier = coord.metrics.extra.get("pace") or {}  # an earlier incarnation's counts (a recovery's restart)
        self.tasks_cached = earlier.get("tasks_without_params") or 0  # tasks whose every pull the copy served (ssp_cache)
        self._reported_before = (earlier.get("tasks_with_params") or 0) + self.tasks_cached  # since then: record.pushes
        self.handed = 0 if self.rounds else start_step  # tasks handed out (async / SSP: since the run began, a
        # partition's step)
        self._heard: dict[int, float] = {}
        self._last = start
        self._selector = selectors.DefaultSelector()
        for w in workers:
            self.clock.join(w.rank)
            self._selector.register(w.conn.sock, selectors.EVENT_READ, (w, w.conn))
            self._heard[w.rank] = time.monotonic()
        self.cut = PacedCheckpoints(cfg, start_step, not self.rounds, client)
        self._restart_clocks(start_step)
        self.given = dict(self.clock.clocks)  # rank -> tasks handed out to it (its next task's clock)
        if not self.rounds and shard.checkpointer is not None:  # the coordinator's shard saves the handout
            shard.checkpointer.run_meta = lambda: handout_meta(self.handed, dict(self.given))

    def _restart_clocks(self, start_step: int) -> None:
        """A restored run's clocks: in rounds every worker at the round `start_step`; under async / a bound
        the clocks saved at the cut (`wiiide.server.ps.paced_checkpoints.restored_clocks`), else all at 0."""
        if not start_step:
            return
        recovery = self.coord.recovery
        saved = (restored_clocks(recovery.restored_run, list(self.clock.clocks), start_step)
                 if recovery is not None and recovery.restored_step == start_step and not self.rounds else None)
        for rank in self.clock.clocks:
            self.clock.clocks[rank] = start_step if self.rounds else (saved or {}).get(rank, 0)
        if recovery is not None and not self.rounds:  # the workers' rejoin hints count their own tasks
            recovery.hint_unit = ("worker_tasks", max(self.clock.clocks.values()))

    # ------------------------------------------------------------------------------------------
    def run(self) -> None:
        """Hand out and record until duration_s, max_steps updates or the target (or a worker waits to
        rejoin), then until every batch handed out is reported. Raises NodeFailure (exit 4) when a worker
        or the shard is lost."""
        cfg, metrics = self.cfg, self.coord.metrics
        try:
            while True:
                more = self._more()
                if more:
                    self._hand_out()
                elif not any(self.tasks.values()):
                    break
                for w, conn in ready_connections(self._selector, POLL_S):
                    self._read(w, conn)
                if self.shard.failure:
                    raise NodeFailure(self.shard.failure, EXIT_PEER_LOST)
                self._check_silent()
        finally:
            self._selector.close()
            if self.members is not None:  # a loss's tasks in flight: a recovery's steps_lost
                self.members.unreported = sum(len(q) for q in self.tasks.values())
            metrics.train_time_s = time.perf_counter() - self.start
            metrics.extra["epochs"] = self.sampler.epochs_done
            metrics.extra.update(self.record.to_extra())
            reported = self._reported_before + sum(self.record.pushes.values())
            metrics.extra["pace"] = {
                "placement": "sharded", "staleness_bound": cfg.staleness_bound, "local_steps": cfg.local_steps,
                "ssp_cache": cfg.ssp_cache, "tasks_with_params": reported - self.tasks_cached,
                "tasks_without_params": self.tasks_cached,
                "outer_optimizer": None, "staleness_scaling": cfg.staleness_scaling,
                "adaptive_batch": cfg.adaptive_batch, "grad_accum_steps": cfg.grad_accum_steps,
                "updates": metrics.steps, "tasks_handed_out": self.handed, "checkpoint_cut": self.cut.record()}

    def _more(self) -> bool:
        cfg = self.cfg
        if self.members is not None and self.members.rejoin_due():  # drain, then readmit (as the barrier does)
            return False
        if stop_at_target(cfg, self.evaluator) or time.perf_counter() - self.start >= cfg.duration_s:
            return False
        if not cfg.max_steps:
            return True
        if self.rounds:  # a round is one update of every partition
            return min(self.clock.clocks[r] + len(q) for r, q in self.tasks.items()) < cfg.max_steps
        return self.handed < cfg.max_steps  # each push is one update

    # --- handout -----------------------------------------------------------------------------------
    def _hand_out(self) -> None:
        """Send a batch to every worker that holds fewer than TASKS_AHEAD + 1 and whose next task the SSP
        rule allows (in rounds: the shards keep the step; the handout runs TASKS_AHEAD ahead)."""
        cfg = self.cfg
        for w in self.workers:
            queued = self.tasks[w.rank]
            if len(queued) > TASKS_AHEAD:
                continue
            step = self.clock.clocks[w.rank] + len(queued)
            if self.limit is not None and step - self.clock.slowest() > self.limit:
                continue
            if self.rounds and cfg.max_steps and step >= cfg.max_steps:
                continue
            if not self.rounds and cfg.max_steps and self.handed >= cfg.max_steps:
                return
            limit = self.cut.limit()
            if limit is not None and self.handed >= limit:  # a checkpoint's cut: drain first
                self.cut.held()
                return
            self._send(w, step, self._batch_size(w.rank, step))

    def _batch_size(self, rank: int, step: int) -> int:
        if self.adaptive is None:
            return self.sampler.batch_size
        ranks = [w.rank for w in self.workers]
        if self.rounds:  # one split per round: the round's batches sum to the global batch
            if step not in self.round_sizes:
                self.round_sizes[step] = self.adaptive.sizes(ranks)
            return self.round_sizes[step][rank]
        bounded = self.clock.bound is not None and self.clock.bound > 0
        return self.adaptive.sizes(ranks, self.clock.clocks if bounded else None)[rank]

    def _send(self, w: Any, step: int, batch_size: int) -> None:
        """Hand `w` its task `step`: `batch_size` rows, H x that many with local SGD (`round_rows`)."""
        idx = self.sampler.next_indices(round_rows(self.cfg, batch_size, len(self.data.y_train)))
        frame = batch_frame(self.coord.policy, self.data, self.handout[w.rank], step, idx)
        now = time.perf_counter()
        try:
            w.conn.send([frame])
        except OSError as exc:
            self._lost(w, exc)
        self.tasks[w.rank].append(_Task(step, len(idx), now))
        self.given[w.rank] = step + 1
        self.handed += 1
        self.record.batch_size(w.rank, now - self.start, batch_size)

    # --- reports -----------------------------------------------------------------------------------
    def _read(self, w: Any, conn: Any) -> None:
        """Read the one frame `w`'s readable connection holds: a heartbeat, ``step_done`` or ``ps_failed``."""
        try:
            t0 = time.perf_counter()
            msg = conn.reader.read_message()
            conn.metrics.record_received(msg, time.perf_counter() - t0)
        except Exception as exc:  # OSError, ProtocolError, a timeout mid-frame
            self._lost(w, exc)
        self._heard[w.rank] = time.monotonic()
        if msg.kind == "heartbeat":
            return
        if msg.kind == PS_FAILED:
            raise NodeFailure(f"worker {w.rank}: {str(msg.meta.get('cause'))[:400]}", EXIT_PEER_LOST)
        try:
            done = self._check(w, msg)
        except ProtocolError as exc:
            self._lost(w, exc)
        self._applied(w, done)

    def _check(self, w: Any, msg: Any) -> _Done:
        """The report of `w`'s oldest task from its ``step_done``. Raises ProtocolError."""
        if msg.kind != "step_done":
            raise ProtocolError(f"{msg.kind!r} where ['step_done'] was expected")
        queued = self.tasks[w.rank]
        if not queued or msg.meta.get("step") != queued[0].step:
            raise ProtocolError(f"step_done for step {msg.meta.get('step')!r:.40}, expected "
                                f"{queued[0].step if queued else 'none (no batch handed out)'}")
        task = queued.popleft()
        loss, staleness = msg.meta.get("loss"), msg.meta.get("staleness", 0)
        if type(staleness) is not int or not 0 <= staleness <= MAX_STALENESS:  # noqa: E721
            raise ProtocolError(f"step_done: 'staleness' must be an integer 0..{MAX_STALENESS}, got {staleness!r:.40}")
        compute_s, cached = compute_seconds(msg.meta), msg.meta.get("cached", 0)
        if type(cached) is not int or not 0 <= cached <= self.partitions:  # noqa: E721
            raise ProtocolError(f"step_done: 'cached' must be an integer 0..{self.partitions}, got {cached!r:.40}")
        if self.adaptive is not None:  # the worker's own compute time; else the round trip
            self.adaptive.observe(w.rank, task.samples, compute_s if compute_s is not None
                                  else time.perf_counter() - task.sent_at)
        loss = float(loss) if isinstance(loss, (int, float)) and not isinstance(loss, bool) else float("nan")
        return _Done(w.rank, task.samples, loss, staleness, compute_s, cached)

    def _applied(self, w: Any, done: _Done) -> None:
        """Tick `w`'s clock; record the update it completes (async / SSP: its own; rounds: the round's, once
        every worker reported it)."""
        w.batches += 1
        step = self.clock.clocks[w.rank]
        self.clock.tick(w.rank)
        self.record.clock_gap(self.clock.gap())
        if not self.rounds:
            self._update([done])
            return
        parts = self.round_done.setdefault(step, [])
        parts.append(done)
        if len(parts) == len(self.workers):
            del self.round_done[step]
            self.round_sizes.pop(step, None)
            self._update(parts)

    def _update(self, parts: list[_Done]) -> None:
        metrics, now = self.coord.metrics, time.perf_counter()
        for part in parts:
            self.record.applied(part.rank, part.staleness, part.samples)
            if self.partitions and part.cached == self.partitions:
                self.tasks_cached += 1
        samples = sum(p.samples for p in parts)
        metrics.steps += 1
        metrics.batches += len(parts)
        metrics.samples += samples
        metrics.record_step_time(now - self._last)
        metrics.record_workers_compute([p.compute_s for p in parts])
        metrics.losses.append(sum(p.samples * p.loss for p in parts) / samples)
        self._last = now
        self.cut.after_update(metrics.steps, self.handed, max(self.given.values()))
        if self.coord.recovery is not None:  # the recovery figures at the first update after a restart
            self.coord.recovery.note_step(metrics.steps)
        if self.members is not None:  # the same after a worker's loss (wiiide.server.ps.membership)
            self.members.note_step(metrics.steps)
        if metrics.steps % 50 == 0:
            metrics.sample_rss()
        self.coord.log.step(metrics.steps, "update %d: loss %.4f, %d push(es), %.1f samples/s (sharded)",
                            metrics.steps, metrics.losses[-1], len(parts), metrics.samples / (now - self.start))

    # --- losses ------------------------------------------------------------------------------------
    def _check_silent(self) -> None:
        now = time.monotonic()
        for w in self.workers:
            if now - self._heard[w.rank] > self.cfg.io_timeout_s:
                self._lost(w, TimeoutError(f"no frame for io_timeout_s={self.cfg.io_timeout_s:g} s"))

    def _lost(self, w: Any, cause: BaseException) -> None:
        """Drop `w` and end this incarnation (the coordinator recovers over the survivors). Raises NodeFailure."""
        self.coord.drop(w, cause)
        raise NodeFailure(f"lost worker {w.rank} ({w.node_id}): {type(cause).__name__}: {cause}",
                          EXIT_PEER_LOST) from None
