"""A shard's side of pacing (`wiiide.server.ps.paced` is the coordinator's): under async or a staleness bound
every push is applied as it arrives, scaled by its staleness, and answered to the pushing worker alone;
in rounds of adaptive batches a push carries its ``samples``, by which the shard weights it.

Sparse rows (`wiiide.server.ps.sparse_rows`) under async and a bound: a push's touched rows are applied as
they arrive, and the pull to the pushing worker carries every row of the partition changed since that
worker's last pull, as values to copy in; in rounds of adaptive batches the rows are averaged weighted
by the pushes' samples.

With local SGD (``local_steps`` H > 1) a push is a model delta (`wiiide.server.ps.local_sgd`). Applied on
arrival it counts as its worker's share of the mean, ``delta / workers``, through the outer step, as the
central pace server applies it (`wiiide.server.pace.server`). Once every worker has pushed, the partition
has moved by the mean delta, as in rounds.

The SSP cache (``ssp_cache``, a bound s >= 1): SSP asks only that a worker at clock ``c`` computes on
parameters holding every worker's first ``c - s`` pushes (Ho et al. 2013), and Petuum's SSP tables keep
that rule per row of a table, so a shard keeps it per partition: it knows every worker's clock here (the
task index of its last push applied, + 1, ``clocks``) and, per worker, the slowest of those clocks when
it last sent that worker the partition (``held``). When the copy a worker holds still satisfies the rule
for its next task, the push is applied and answered with `CACHED_KIND`: no parameters, the worker keeps
its copy (its replica here is unchanged, so the next pull's delta covers every step it skipped, and the
next push's staleness counts from that copy). A worker whose clock here is not known yet (it has not
pushed in this incarnation) counts as clock 0, so a copy is never taken for fresher than it is.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from wiiide.errors import ProtocolError
from wiiide.server.pace.staleness import staleness_scale
from wiiide.server.ps.sparse_rows import ROWS_PULL_KIND, rows_frame
from wiiide.server.sparse import sgd_rows
from wiiide.wire.encode import encode_message
from wiiide.wire.messages import Frame

CACHED_KIND = "ps_cached"  # shard -> worker, ssp_cache: the push applied; compute on the copy you hold


def apply_on_arrival(shard: Any, owned: Any, rank: int, values: np.ndarray | tuple, push_step: Any) -> Frame:
    """Async / SSP: one optimizer step of `shard` (a `wiiide.server.ps.shard.ShardServer`) on partition `owned`
    from worker `rank`'s push `values` (float32, the partition's numel; a row partition's (ids, rows):
    `_rows_on_arrival`), scaled by ``staleness_scale(k)`` (and by 1 / workers for local SGD's model
    deltas) with k = the partition's updates since the shard last sent `rank` its copy; returns the pull
    for `rank` alone, a delta against that worker's replica (meta: the push's step, ``staleness``: k,
    ``version``: the partition's updates so far, which a recovery reads, `wiiide.server.ps.paced_recovery`).
    The caller holds the shard's lock."""
    t0, cpu0 = time.perf_counter(), time.thread_time()
    staleness = owned.step - owned.sent[rank]
    scale = staleness_scale(staleness, shard.cfg.staleness_scaling)
    if shard.cfg.local_steps > 1:  # a model delta: this worker's share of the mean (module docstring)
        scale /= max(1, shard.num_workers)
    cached = _copy_serves(shard, owned, rank, push_step)
    frame = (_rows_on_arrival(shard, owned, rank, *values, scale, push_step, staleness, cached) if isinstance(values, tuple)
             else _dense_on_arrival(shard, owned, rank, values, scale, push_step, staleness, cached))
    shard.update_s += time.perf_counter() - t0
    shard.metrics.add_stage_cpu("update", push_step, time.thread_time() - cpu0)
    return frame


def _copy_serves(shard: Any, owned: Any, rank: int, push_step: Any) -> bool:
    """ssp_cache (module docstring): record `rank`'s clock on this partition (its push of task `push_step`, an
    int checked by the shard, applied: clock ``push_step + 1``) and say whether the copy it holds may serve
    its next task, the one at that clock: held slowest clock >= clock - s. False without ``ssp_cache``."""
    if type(push_step) is not int or push_step < 0:  # noqa: E721
        raise ProtocolError(f"push of partition {owned.part.index}: step {push_step!r:.40} is not a task index")
    clock = push_step + 1
    owned.clocks[rank] = clock
    return shard.cfg.ssp_cache and owned.held.get(rank, -1) >= clock - shard.cfg.staleness_bound


def _cached_or_sent(shard: Any, owned: Any, rank: int, meta: dict, cached: bool) -> Frame | None:
    """The `CACHED_KIND` answer when `cached`, else None after recording that `rank` is sent the partition
    now (its copy's version, and the slowest clock it holds, ``held``). Holds the shard's lock."""
    if cached:
        shard.stats["pulls_cached"] = shard.stats.get("pulls_cached", 0) + 1
        return encode_message(CACHED_KIND, {k: meta[k] for k in ("step", "partition", "staleness")})
    owned.sent[rank] = owned.step
    if shard.cfg.ssp_cache:
        owned.held[rank] = min(owned.clocks.get(r, 0) for r in owned.sent)
    return None


def _dense_on_arrival(shard: Any, owned: Any, rank: int, values: np.ndarray, scale: float, push_step: Any,
                      staleness: int, cached: bool) -> Frame:
    """A dense partition's push applied as it arrives (`apply_on_arrival`); `cached`: answered with
    `CACHED_KIND` (`_copy_serves`). Holds the shard's lock."""
    owned.param.grad.copy_(torch.from_numpy(values)).mul_(scale)
    step = owned.step
    owned.optimizer.lr = shard.lrs.schedule.lr(step)
    shard.lrs.applied(step, owned.optimizer.lr)
    owned.optimizer.step()
    owned.step += 1
    shard.updates += 1
    index = owned.part.index
    dense = not shard._delta_pulls or (shard._lossy and step < shard._warmup_steps)
    meta = {"step": push_step, "partition": index, "staleness": staleness, "version": owned.step}
    skip = _cached_or_sent(shard, owned, rank, meta, cached)
    if skip is not None:
        return skip
    return owned.replicas[rank].frame_for(shard.policy, meta, f"p{index}", owned.param.numpy(), dense)


def push_samples(meta: dict, index: int) -> int:
    """A push's ``samples`` (adaptive batches in rounds weight the pushes by them). Raises ProtocolError."""
    samples = meta.get("samples")
    if type(samples) is not int or not 1 <= samples <= 2**31:  # noqa: E721
        raise ProtocolError(f"push of partition {index}: 'samples' must be an integer >= 1, got {samples!r:.40}")
    return samples


def _rows_on_arrival(shard: Any, owned: Any, rank: int, ids: np.ndarray, rows: np.ndarray, scale: float,
                     push_step: Any, staleness: int, cached: bool) -> Frame:
    """A row partition's push applied as it arrives: `wiiide.server.sparse.sgd_rows` on its touched rows
    (`ids` partition-local, `rows` float32 (u, dim), times `scale`), every worker's record of changed rows
    marked (``owned.dirty``: a bool per row of the partition), and the pull for `rank`: the current values of
    every row changed since its last pull (``set`` in the meta: the worker copies them in), so its copy of
    the partition is the shard's again; `cached`: `CACHED_KIND`, the rows stay marked. Holds the shard's lock."""
    table, index = shard.table, owned.part.index
    values = owned.param.view(-1, table.dim)
    if not owned.dirty:
        owned.dirty = {r: np.zeros(values.shape[0], dtype=bool) for r in owned.sent}
    lr = shard.lrs.schedule.lr(owned.step)
    shard.lrs.applied(owned.step, lr)
    lr = rows_rate(shard.cfg, lr)
    grad = torch.from_numpy(rows)
    sgd_rows(values, torch.from_numpy(ids.astype(np.int64)), grad * scale if scale != 1 else grad, lr)
    owned.step += 1
    shard.updates += 1
    for mask in owned.dirty.values():
        mask[ids] = True
    meta = {"step": push_step, "partition": index, "staleness": staleness, "version": owned.step, "lr": lr, "set": True}
    skip = _cached_or_sent(shard, owned, rank, meta, cached)
    if skip is not None:
        return skip
    changed = np.flatnonzero(owned.dirty[rank])
    owned.dirty[rank][changed] = False
    return rows_frame(ROWS_PULL_KIND, meta, table, changed, values[torch.from_numpy(changed)].clone())


def rows_rate(cfg: Any, lr: float) -> float:
    """The rate a shard's SGD on rows runs at: the schedule's `lr`, or 1 with local SGD (``local_steps`` > 1,
    outer ``avg``: the rows move by the mean model delta, ``params -= delta``)."""
    return 1.0 if cfg.local_steps > 1 else lr
