"""A shard's side of pacing (`wiiide.server.ps.paced` is the coordinator's): under async or a staleness bound
every push is applied as it arrives, scaled by its staleness, and answered to the pushing worker alone;
in rounds of adaptive batches a push carries its ``samples``, by which the shard weights it.

With local SGD (``local_steps`` H > 1) a push is a model delta (`wiiide.server.ps.local_sgd`). Applied on
arrival it counts as its worker's share of the mean, ``delta / workers``, through the outer step, as the
central pace server applies it (`wiiide.server.pace.server`). Once every worker has pushed, the partition
has moved by the mean delta, as in rounds.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from wiiide.errors import ProtocolError
from wiiide.server.pace.staleness import staleness_scale
from wiiide.wire.messages import Frame


def apply_on_arrival(shard: Any, owned: Any, rank: int, values: np.ndarray, push_step: Any) -> Frame:
    """Async / SSP: one optimizer step of `shard` (a `wiiide.server.ps.shard.ShardServer`) on partition `owned`
    from worker `rank`'s push `values` (float32, the partition's numel), scaled by ``staleness_scale(k)``
    (and by 1 / workers for local SGD's model deltas) with k = the partition's updates since the shard last sent `rank` its copy; returns the pull for
    `rank` alone, a delta against that worker's replica (meta: the push's step, ``staleness``: k,
    ``version``: the partition's updates so far, which a recovery reads, `wiiide.server.ps.paced_recovery`).
    The caller holds the shard's lock."""
    t0, cpu0 = time.perf_counter(), time.thread_time()
    staleness = owned.step - owned.sent[rank]
    scale = staleness_scale(staleness, shard.cfg.staleness_scaling)
    if shard.cfg.local_steps > 1:  # a model delta: this worker's share of the mean (module docstring)
        scale /= max(1, shard.num_workers)
    owned.param.grad.copy_(torch.from_numpy(values)).mul_(scale)
    step = owned.step
    owned.optimizer.lr = shard.lrs.schedule.lr(step)
    shard.lrs.applied(step, owned.optimizer.lr)
    owned.optimizer.step()
    owned.step += 1
    owned.sent[rank] = owned.step
    shard.updates += 1
    index = owned.part.index
    dense = not shard._delta_pulls or (shard._lossy and step < shard._warmup_steps)
    meta = {"step": push_step, "partition": index, "staleness": staleness, "version": owned.step}
    frame = owned.replicas[rank].frame_for(shard.policy, meta, f"p{index}", owned.param.numpy(), dense)
    shard.update_s += time.perf_counter() - t0
    shard.metrics.add_stage_cpu("update", push_step, time.thread_time() - cpu0)
    return frame


def push_samples(meta: dict, index: int) -> int:
    """A push's ``samples`` (adaptive batches in rounds weight the pushes by them). Raises ProtocolError."""
    samples = meta.get("samples")
    if type(samples) is not int or not 1 <= samples <= 2**31:  # noqa: E721
        raise ProtocolError(f"push of partition {index}: 'samples' must be an integer >= 1, got {samples!r:.40}")
    return samples
