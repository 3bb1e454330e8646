"""The central parameter server's loop when workers go at their own pace.

`wiiide.server.coordinator.Coordinator` runs this instead of its synchronous rounds when ``staleness_bound``
is not 0, ``local_steps`` > 1 or ``adaptive_batch`` is on (`uses_pace`). Each worker gets a task
(the current parameters and its batch: ``local_steps`` x its batch size rows) as soon as the SSP rule
lets it (`wiiide.server.pace.staleness.SSPClock`) and pushes a gradient (H = 1, tensor ``grad``) or a model
delta (H > 1, tensor ``delta``; `wiiide.server.pace.outer`). One thread does it all: it waits on every worker's
socket at once (`selectors`), reads the frame of whichever is ready, applies it and sends tasks. (A
receiver thread per worker was the first design: every frame then cost two thread hand-offs, which
on 2 loaded cores took tens of milliseconds each, and a reader that reuses its buffer must not read
the next frame before the main thread has copied the last.) A worker silent for ``io_timeout_s``
(no frame, not even a heartbeat) is dropped, as a timed-out read drops it in the synchronous loop.

How updates are applied:

- ``staleness_bound: 0`` (rounds): updates are kept until every live worker has pushed once, then their
  mean weighted by samples (the gradient of the whole global batch; with equal batches the plain mean
  the synchronous loop takes) is applied in one step: the coordinator's optimizer for gradients, the
  outer optimizer for deltas. This is how adaptive batch sizes and local SGD run in synchronous rounds.
- ``s > 0`` or ``async``: each update is applied when it arrives, ``k`` = versions applied since its
  worker read the parameters, scaled by `staleness_scale` (``staleness_scaling``: none, as SSP does, or
  1 / (k + 1), Zhang et al. 2016). A gradient is one optimizer step (asynchronous SGD, Dean et al. 2012);
  a delta is applied as its worker's share of the average, ``delta / live workers``, so that once every
  worker has pushed the parameters moved by the mean delta, as in synchronous rounds.

The SSP cache (``ssp_cache``, a bound s >= 1 and gradient pushes): SSP asks only that a worker at clock
``c`` computes on parameters holding every worker's first ``c - s`` pushes (Ho et al. 2013: its workers
read a local cache and refresh it only when it is that stale). The server remembers, per worker, the
version it last sent and the slowest clock then (every worker had pushed that many times, all applied),
and sends the parameters with a task only when that clock is below ``c - s``; otherwise the task is the
batch alone and the worker computes on the copy it holds (the staleness recorded is against that
copy's version). Off, every task carries the newest parameters.

Sparse embedding rows (``sparse_embedding``): pushes carry the touched rows, updates move only them, and a
task's parameters are the rows changed since the copy its worker holds (`wiiide.server.pace.rows`).

Local SGD with a lossy compression policy (``compression: fixed:int8``, say) compresses the outer step
both ways (`wiiide.server.pace.compress`): each worker pushes its delta with an error-feedback residual, and
its parameters go out as a delta against the copy it holds, which the server tracks.

Workers leave (a failed connection or a malformed frame: dropped, their task lost, the clock no longer
waits for them) and come back (`Coordinator._admit_waiting`; they start at the slowest live clock).
"""

from __future__ import annotations

import selectors
import socket
import time
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from wiiide.codecs.policy import CompressionPolicy
from wiiide.config import RunConfig
from wiiide.training.data import BatchSampler
from wiiide.errors import ProtocolError
from wiiide.training.evaluation import record_held_out, stop_at_target
from wiiide.lr_schedule import LrRecord, LrSchedule
from wiiide.training.model import FlatParams, MomentumSGD
from wiiide.server.pace.adaptive import AdaptiveBatch
from wiiide.server.pace.checkpoints import checkpoint_after_update, resume_from
from wiiide.server.pace.compress import ReplicaPulls
from wiiide.server.pace.reading import compute_seconds, ready_connections
from wiiide.server.pace.rows import PaceRows
from wiiide.server.pace.outer import OuterOptimizer
from wiiide.server.pace.record import PaceRecord, pace_extra
from wiiide.server.pace.staleness import SSPClock, staleness_scale
from wiiide.server.pace.feedback import policy_may_be_lossy
from wiiide.wire.tensors import to_wire
from wiiide.wire.messages import WireTensor

POLL_S = 0.2  # how often the loop looks at the clock, at silent and at joining workers when no frame arrives


def uses_pace(cfg: RunConfig) -> bool:
    """True when the run needs this loop rather than the coordinator's synchronous rounds."""
    return cfg.staleness_bound != 0 or cfg.local_steps > 1 or cfg.adaptive_batch


class Host(Protocol):
    """What the loop needs of the parameter server that holds the connections (`Coordinator`)."""

    cfg: RunConfig
    metrics: Any
    log: Any
    policy: Any
    workers: list
    evaluator: Any  # wiiide.training.evaluation.BackgroundEvaluator or None (eval_every_s = 0)
    sparse: Any  # wiiide.server.sparse.SparseRows with sparse_embedding, else None

    def _admit_waiting(self) -> None: ...
    def _live(self) -> list: ...
    def drop(self, worker: Any, cause: BaseException) -> None: ...


@dataclass
class _Task:
    task_id: int
    version: int  # server version of the parameters sent
    sent_at: float  # time.perf_counter()
    samples: int


@dataclass
class _Part:
    """One push in an update: its worker, samples, mean loss and staleness (versions)."""

    worker: Any
    samples: int
    loss: float
    staleness: int


class PaceServer:
    """One training run at the workers' own pace on `host`'s connections (see the module docstring).

    Args:
        host: the coordinator (connections, metrics, log, compression policy).
        data: the dataset (`wiiide.training.data.Dataset`: x_train float32 (n, f), y_train int64 (n,)).
        flat: the model's `FlatParams`; optimizer: the coordinator's optimizer (gradient updates).
    """

    def __init__(self, host: Host, data: Any, flat: FlatParams, optimizer: MomentumSGD) -> None:
        cfg = host.cfg
        self.host, self.cfg, self.data, self.flat, self.optimizer = host, cfg, data, flat, optimizer
        self.clock = SSPClock(cfg.staleness_bound)
        self.rounds = cfg.staleness_bound == 0
        self.local_steps = cfg.local_steps
        self.tensor_name = "grad" if cfg.local_steps == 1 else "delta"
        self.outer = (OuterOptimizer(flat, cfg.outer_optimizer, cfg.outer_learning_rate, cfg.outer_momentum)
                      if cfg.local_steps > 1 else None)
        # a restarted coordinator's checkpoint (wiiide.server.pace.checkpoints): version, seconds, tasks handed out
        self.resume = resume_from(getattr(host, "recovery", None), self.outer)
        self.sampler = BatchSampler(len(data.y_train), cfg.batch_size, cfg.seed + self.resume.step)
        self.adaptive = (AdaptiveBatch(cfg.num_workers * self.sampler.batch_size, cfg.adaptive_smoothing,
                                       clock_gain=cfg.adaptive_clock_gain) if cfg.adaptive_batch else None)
        self.record = PaceRecord()
        # the rate of version v (wiiide.lr_schedule): the server's step for gradients; for local SGD the
        # workers' inner rate in the tasks handed out at version v (the outer step keeps its own rate)
        self.lrs = LrRecord(LrSchedule.from_config(cfg), self.resume.step)
        self.version = self.resume.step
        self._selector = selectors.DefaultSelector()
        self._receivers: dict[int, Any] = {}  # rank -> the connection registered with the selector
        self._heard: dict[int, float] = {}  # rank -> time.monotonic() of its last frame
        self._tasks: dict[int, _Task] = {}  # rank -> its task in flight
        self._buffer: list[tuple[torch.Tensor, _Part]] = []  # rounds: the pushes of the round so far
        self._params_frame: tuple[int, Any] | None = None  # (version, frame)
        # ssp_cache: rank -> (version of the parameters the worker holds, slowest live clock when sent)
        self._held: dict[int, tuple[int, int]] | None = {} if cfg.ssp_cache else None
        self.params_sent = self.params_skipped = 0  # tasks with and without parameters
        # local SGD with a lossy policy: pulls as deltas against each worker's copy (wiiide.server.pace.compress),
        # through a policy of their own (dense for the first lossy_warmup_steps versions)
        self.rows = (PaceRows(host.sparse, cfg.local_steps > 1, cfg.adaptive_batch)
                     if getattr(host, "sparse", None) is not None else None)  # raw row frames, no lossy pulls
        self.pulls = (ReplicaPulls(CompressionPolicy.from_config(cfg.replace(lossy_warmup_steps=0)))
                      if cfg.local_steps > 1 and policy_may_be_lossy(cfg) and self.rows is None else None)
        self.next_task = self.resume.next_task
        self._start = self._last_apply = 0.0
        self._draining = False
        self._evaluator = None  # wiiide.training.evaluation.BackgroundEvaluator, started in run()

    # ------------------------------------------------------------------------------------------
    def run(self) -> None:
        """Train until duration_s, max_steps updates or (stop_at_target) the held-out target; records into
        the host's metrics."""
        cfg, metrics = self.cfg, self.host.metrics
        self._last_apply = time.perf_counter()
        self._start = self._last_apply - self.resume.train_s  # a restored run's seconds count towards duration_s
        evaluator = self.host.evaluator
        self._evaluator = evaluator.start(self._start) if evaluator else None
        self.host.log.info("training at the workers' pace for %g s%s: staleness_bound %s, local_steps %d, "
                           "adaptive_batch %s", cfg.duration_s, f" or {cfg.max_steps} updates" if cfg.max_steps else "",
                           cfg.staleness_bound, cfg.local_steps, cfg.adaptive_batch)
        try:
            while not self._done():
                self._sync_workers()
                self._dispatch_ready()
                for worker, conn in self._ready(POLL_S):
                    if cfg.max_steps and self.version >= cfg.max_steps:  # no push read after it applies past it
                        break
                    self._read(worker, conn)
                self._drop_silent()
            metrics.train_time_s = time.perf_counter() - self._start - self.resume.train_s  # this incarnation's
            if self._evaluator:
                self._evaluator.finish(self.version, metrics.samples, self.flat.params)
                record_held_out(metrics, self._evaluator)
            self._drain()
        finally:
            self._selector.close()
            if self.pulls is not None:
                self.pulls.policy.close()
            if not metrics.train_time_s:
                metrics.train_time_s = time.perf_counter() - self._start - self.resume.train_s
            metrics.extra.update(pace_extra(self))

    def _drain(self) -> None:
        """Wait (up to io_timeout_s) for the tasks still in flight and discard them, so that no worker
        sends its last push into a connection the coordinator has closed (a worker in the middle of H
        local steps when time is up would otherwise see a broken pipe and fail)."""
        self._draining = True
        deadline = time.monotonic() + self.cfg.io_timeout_s
        while any(r in self._tasks for r in self._live_ranks()) and time.monotonic() < deadline:
            for worker, conn in self._ready(POLL_S):
                self._read(worker, conn)

    def _ready(self, timeout_s: float) -> list[tuple[Any, Any]]:
        return ready_connections(self._selector, timeout_s)

    def _done(self) -> bool:
        cfg = self.cfg
        return (stop_at_target(cfg, self._evaluator) or time.perf_counter() - self._start >= cfg.duration_s
                or bool(cfg.max_steps and self.version >= cfg.max_steps))

    # --- workers joining and leaving ---------------------------------------------------------------
    def _sync_workers(self) -> None:
        """Admit workers that (re)joined; register every live connection not yet registered."""
        self.host._admit_waiting()
        for w in self.host._live():
            if self._receivers.get(w.rank) is not w.conn:
                self._unregister(w.rank)
                self._selector.register(w.conn.sock, selectors.EVENT_READ, (w, w.conn))
                self._receivers[w.rank] = w.conn
                self._heard[w.rank] = time.monotonic()
                self._tasks.pop(w.rank, None)
                self.clock.join(w.rank)
                self._forget_copy(w.rank)  # a new connection: its worker holds no copy yet

    def _unregister(self, rank: int) -> None:
        conn = self._receivers.pop(rank, None)
        if conn is not None:
            try:
                self._selector.unregister(conn.sock)
            except (KeyError, ValueError, OSError):  # already closed
                pass

    def _read(self, worker: Any, conn: Any) -> None:
        """Read the one frame `worker`'s readable socket holds (a plain socket's reader reads exact frame
        lengths, so nothing is left buffered behind it; what TLS read ahead, `_ready` finds); heartbeats
        only prove it alive."""
        if self._receivers.get(worker.rank) is not conn:
            return
        try:
            t0 = time.perf_counter()
            msg = conn.reader.read_message()
            conn.metrics.record_received(msg, time.perf_counter() - t0, conn.name)
            if msg.kind not in ("heartbeat", "gradients"):
                raise ProtocolError(f"{conn.name} sent a {msg.kind!r} message where ['gradients'] was expected")
        except Exception as exc:  # OSError, ProtocolError, timeout mid-frame: a drop with its cause
            self._lose(worker, exc)
            return
        self._heard[worker.rank] = time.monotonic()
        if msg.kind == "gradients":
            self._handle(worker, conn, msg)

    def _drop_silent(self) -> None:
        """Drop every worker silent for io_timeout_s (its heartbeats stopped too: paused, cut off)."""
        now = time.monotonic()
        for w in list(self.host.workers):
            if w.alive and w.rank in self._receivers and now - self._heard.get(w.rank, now) > self.cfg.io_timeout_s:
                self._lose(w, socket.timeout(f"no frame for io_timeout_s={self.cfg.io_timeout_s:g} s"))

    def _lose(self, worker: Any, cause: Exception) -> None:
        self._unregister(worker.rank)
        self.host.drop(worker, cause)
        if worker.rank in self.clock.live:
            self.clock.leave(worker.rank)
        self._tasks.pop(worker.rank, None)
        self._forget_copy(worker.rank)
        self._close_round()

    def _forget_copy(self, rank: int) -> None:
        """Forget what this server knows of the parameters `rank` holds (the lossy pulls' replica, the
        SSP cache's version): the next task sends it parameters in full."""
        if self.pulls is not None:
            self.pulls.forget(rank)
        if self.rows is not None:
            self.rows.forget(rank)
        if self._held is not None:
            self._held.pop(rank, None)

    def _live_ranks(self) -> list[int]:
        return [w.rank for w in self.host.workers if w.alive and self._receivers.get(w.rank) is w.conn]

    # --- tasks -------------------------------------------------------------------------------------
    def _dispatch_ready(self) -> None:
        """Send a task to every live idle worker the SSP clock lets go on."""
        ready = [w for w in self.host.workers if w.alive and self._receivers.get(w.rank) is w.conn
                 and w.rank not in self._tasks and self.clock.may_proceed(w.rank)]
        if not ready or (self.rounds and self._buffer):
            return
        sizes = None
        if self.adaptive is not None:  # under a bound, the clocks too (wiiide.server.pace.adaptive)
            bounded = self.clock.bound is not None and self.clock.bound > 0
            sizes = self.adaptive.sizes(self._live_ranks(), self.clock.clocks if bounded else None)
        for w in ready:
            self._dispatch(w, sizes[w.rank] if sizes is not None else self.sampler.batch_size)

    def _copy_is_fresh_enough(self, rank: int) -> bool:
        """ssp_cache: whether the copy `rank` holds has every worker's first ``c - s`` pushes (``c``: its
        clock), so that its next task may go without parameters."""
        held = self._held.get(rank) if self._held is not None else None
        return held is not None and self.clock.copy_is_fresh(rank, held[1])

    def _dispatch(self, worker: Any, batch_size: int) -> None:
        host, data = self.host, self.data
        version = self.version
        if self._copy_is_fresh_enough(worker.rank):
            params_frame = None
            version = self._held[worker.rank][0]
        elif self.pulls is not None:
            params_frame = self.pulls.frame_for(worker.rank, self.version, self.flat.params.numpy(),
                                                dense=self.version < self.cfg.lossy_warmup_steps)
        elif self.rows is not None:  # the rows changed since the worker's copy (wiiide.server.pace.rows)
            params_frame = self.rows.frame_for(worker.rank, self.version, self.flat.params, self._full_params)
        else:
            params_frame = self._full_params()
        rows = min(batch_size * self.local_steps, len(data.y_train))
        idx = self.sampler.next_indices(rows)
        task_id, self.next_task = self.next_task, self.next_task + 1
        batch = [WireTensor("x", data.x_train[idx]), WireTensor("y", data.y_train[idx])]
        meta = {"step": task_id, "local_steps": self.local_steps}
        if self.outer is not None:  # local SGD: the inner steps' rate (a gradient is scaled by the server)
            meta["lr"] = self.lrs.schedule.lr(self.version)
        batch_frame = host.policy.encode("batch", meta, batch)
        now = time.perf_counter()
        try:
            worker.conn.send([batch_frame] if params_frame is None else [params_frame, batch_frame])
        except OSError as exc:
            self._lose(worker, exc)
            return
        if params_frame is None:
            self.params_skipped += 1
        else:
            self.params_sent += 1
            if self._held is not None:
                self._held[worker.rank] = (self.version, self.clock.slowest())
        self._tasks[worker.rank] = _Task(task_id, version, now, len(idx))
        self.record.batch_size(worker.rank, now - self._start, batch_size)

    def _full_params(self) -> Any:
        """The ``params`` frame of the current version (the policy's encoding), made once per version."""
        if self._params_frame is None or self._params_frame[0] != self.version:
            frame = self.host.policy.encode("params", {"step": self.version}, [to_wire("params", self.flat.params)])
            self._params_frame = (self.version, frame)
        return self._params_frame[1]

    # --- updates -----------------------------------------------------------------------------------
    def _handle(self, worker: Any, conn: Any, item: Any) -> None:
        """Check and apply (or keep for the round) one ``gradients`` message of `worker`."""
        if self._draining:  # the run is over: the push is not applied
            self._tasks.pop(worker.rank, None)
            return
        try:
            task = self._tasks.pop(worker.rank, None)
            update, loss = self._check(item, task)
            compute_s = compute_seconds(item.meta)
        except Exception as exc:  # ProtocolError, OverflowError...: a drop with its cause
            self._lose(worker, exc)
            return
        assert task is not None
        self.host.policy.observe_received(item)
        staleness = self.version - task.version
        part = _Part(worker, task.samples, loss, staleness)
        if self.adaptive is not None:  # the worker's own compute time: no wait in this server's queue in it
            round_trip_s = time.perf_counter() - task.sent_at
            self.adaptive.observe(worker.rank, task.samples,
                                  min(compute_s, round_trip_s) if compute_s is not None else round_trip_s)
        self.clock.tick(worker.rank)
        self.record.clock_gap(self.clock.gap())
        if self.rounds:
            self._buffer.append((update, part))
            self._close_round()
            return
        scale = staleness_scale(staleness, self.cfg.staleness_scaling)
        if self.outer is not None:
            scale /= max(1, len(self.clock.live))
        self._apply(update.mul_(scale) if scale != 1.0 else update, [part])

    def _check(self, msg: Any, task: _Task | None) -> tuple[Any, float]:
        """The update of a ``gradients`` frame (a float32 numel tensor, or with sparse rows a checked
        `wiiide.server.pace.rows.RowsUpdate`) and its loss. Raises ProtocolError."""
        if task is None:
            raise ProtocolError("gradients without a task in flight")
        if msg.meta.get("step") != task.task_id:
            raise ProtocolError(f"gradients for task {msg.meta.get('step')!r:.40}, expected {task.task_id}")
        loss = msg.meta.get("loss", float("nan"))
        if isinstance(loss, bool) or not isinstance(loss, (int, float)):
            raise ProtocolError(f"gradients: 'loss' must be a number, got {type(loss).__name__}")
        if self.rows is not None:
            return self.rows.check(msg), float(loss)
        names = [t.name for t in msg.tensors]
        if names != [self.tensor_name]:
            raise ProtocolError(f"gradients carry tensors {names!r:.80}, expected [{self.tensor_name!r}]")
        update = msg.tensor(self.tensor_name)
        if update.shape != (self.flat.numel,) or update.dtype != np.float32:
            raise ProtocolError(f"{self.tensor_name} of shape {update.shape} {update.dtype}, expected "
                                f"({self.flat.numel},) float32")
        return torch.from_numpy(np.array(update, dtype=np.float32, copy=True)), float(loss)

    def _close_round(self) -> None:
        """Rounds: once no live worker has a task in flight, apply the samples-weighted mean of the round."""
        if not self.rounds or not self._buffer or any(r in self._tasks for r in self._live_ranks()):
            return
        total = sum(part.samples for _, part in self._buffer)
        if self.rows is not None:  # summed per id in rank order, as a shard's row partition
            mean = self.rows.mean([(part.worker.rank, update, part.samples) for update, part in self._buffer])
        else:
            mean = torch.zeros(self.flat.numel, dtype=torch.float32)
            for update, part in self._buffer:
                mean.add_(update, alpha=part.samples / total)
        parts = [part for _, part in self._buffer]
        self._buffer = []
        self._apply(mean, parts)

    def _apply(self, update: Any, parts: list[_Part]) -> None:
        """One server update from `update` (a gradient or a delta, already averaged and scaled) of the
        pushes `parts`; only applied pushes count (a round cut short by the end of the run does not)."""
        metrics = self.host.metrics
        for part in parts:
            part.worker.batches += self.local_steps
            self.record.applied(part.worker.rank, part.staleness, part.samples)
        lr = self.lrs.schedule.lr(self.version)
        self.lrs.applied(self.version, lr)
        if self.rows is not None:  # SGD on the touched rows and the rest (local SGD: rate 1)
            self.rows.apply(self.flat.params, update, lr)
        elif self.outer is not None:
            self.outer.step(update)
        else:
            self.flat.grads.copy_(update)
            self.optimizer.lr = lr
            self.optimizer.step()
        self.version += 1
        now = time.perf_counter()
        samples = sum(p.samples for p in parts)
        metrics.steps = self.version
        metrics.batches += len(parts) * self.local_steps
        metrics.samples += samples
        metrics.record_step_time(now - self._last_apply)
        metrics.losses.append(sum(p.samples * p.loss for p in parts) / samples if samples else float("nan"))
        self._last_apply = now
        if self._evaluator:  # a copy of the parameters between updates, evaluated on another thread
            self._evaluator.offer(self.version, metrics.samples, self.flat.params)
        if self.version % 50 == 0:
            metrics.sample_rss()
        checkpoint_after_update(getattr(self.host, "recovery", None), self, now - self._start)
        self.host.log.step(self.version, "update %d: loss %.4f, %d push(es), %.1f samples/s", self.version,
                           metrics.losses[-1], len(parts), metrics.samples / (now - self._start))
