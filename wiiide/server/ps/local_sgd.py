"""Local SGD and DiLoCo on the sharded servers (``ps_shards`` > 1, ``local_steps`` H > 1).

A round of the sharded barrier (`wiiide.server.ps.session`) is one outer step:

1. the coordinator hands each worker H x batch_size rows (``batch`` or ``batch_indices``), as the
   central server's rounds do (`wiiide.server.pace.server`: the same sampler, drawn in rank order);
2. the worker takes H plain SGD steps on them from the parameters it pulled (`wiiide.server.pace.outer.local_delta`,
   at the schedule's rate for the round), puts its model delta ``params_pulled - params_after`` into
   its flat gradient buffer, sets its parameters back to what it pulled (the shards' replica of its
   copy, `wiiide.server.pace.feedback.PullReplica`) and pushes the delta partition by partition to the shards
   that own them (`wiiide.server.ps.client.ShardClient.push_all`; a lossy policy encodes each partition with
   the push's error-feedback residual, `wiiide.server.pace.feedback.ErrorFeedback`);
3. each shard (`shard_optimizer`) averages its partitions' deltas over the workers (in rank order) and applies the outer step
   to its slice (`wiiide.server.pace.outer.PartitionOuterStep`: ``avg``, or DiLoCo's Nesterov with its momentum
   buffer on the shard), then sends the slice back (a delta against the workers' copy, compressed
   both ways as the gradients of synchronous rounds are);
4. the worker applies the pulls to its parameters (`ShardClient.finish_step`) and reports ``step_done``.

So every worker's link carries its delta out and the new parameters in, each cut into k pieces that
go to k nodes, instead of every worker's bytes crossing one server's link. The coordinator still hands
out the batches and keeps the barrier, the held-out evaluation and the stop.

Under a staleness bound, async or adaptive batches (`wiiide.server.ps.paced`) the worker's side is the
same; a task is H batches of the worker's batch size, and a shard applies each delta as it arrives as
its worker's share of the mean (`wiiide.server.ps.shard_pacing`), or in rounds the mean weighted by
the pushes' ``samples``.

With fixed H, seed and fp32 this is the central server's local SGD (`wiiide.server.pace.server`) operation
for operation, except the order in which the mean adds the workers' deltas: the central server adds
them as they arrive, a shard in rank order. With two workers the two orders give the same float32
sum (addition is commutative); with more they can differ in the last bit.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import numpy as np
import torch
from torch import nn

from wiiide.errors import ProtocolError
from wiiide.lr_schedule import LrSchedule
from wiiide.training.model import FlatParams, MomentumSGD
from wiiide.training.models import loss_mean
from wiiide.server.pace.outer import PartitionOuterStep, local_delta
from wiiide.server.recovery import momentum_from_flat, momentum_to_flat

OUTER_MOMENTUM = "outer_momentum"  # a shard checkpoint's name for the outer step's Nesterov buffer


def shard_optimizer(values: torch.Tensor, cfg: Any) -> MomentumSGD | PartitionOuterStep:
    """The optimizer a shard (`wiiide.server.ps.shard`) applies to the partition `values` (float32, 1-D, with
    ``.grad``): with ``local_steps`` > 1 the outer step over the workers' mean model delta
    (`wiiide.server.pace.outer.PartitionOuterStep`: ``outer_optimizer`` avg or nesterov with ``outer_learning_rate``
    and ``outer_momentum``), else `wiiide.training.model.MomentumSGD` at ``learning_rate`` and ``momentum``.
    `cfg` is a `wiiide.config.RunConfig`."""
    if cfg.local_steps > 1:
        return PartitionOuterStep(values, cfg.outer_optimizer, cfg.outer_learning_rate, cfg.outer_momentum)
    return MomentumSGD([values], lr=cfg.learning_rate, momentum=cfg.momentum)


def optimizer_state_name(cfg: Any) -> str:
    """The name of a shard optimizer's state in a shard checkpoint: ``outer_momentum`` (DiLoCo's Nesterov
    buffer) with ``local_steps`` > 1, else ``momentum`` (MomentumSGD's buffer)."""
    return OUTER_MOMENTUM if cfg.local_steps > 1 else "momentum"


def optimizer_state(optimizer: MomentumSGD | PartitionOuterStep) -> np.ndarray | None:
    """A copy of the state a shard's optimizer (`shard_optimizer`) carries from one update to the next, as
    flat float32 (the partition's numel,): MomentumSGD's momentum buffer, or the outer step's Nesterov
    buffer. None when it keeps none: momentum 0, ``avg``, or before the first step. The outer step's
    other state, the anchor parameters it steps from, are the partition's parameters themselves."""
    if isinstance(optimizer, PartitionOuterStep):
        buffer = optimizer.outer.buffer
        return None if buffer is None else buffer.numpy().astype(np.float32, copy=True)
    return momentum_to_flat(optimizer)


def load_optimizer_state(optimizer: MomentumSGD | PartitionOuterStep, vector: np.ndarray) -> None:
    """Set `optimizer_state`'s vector (float32, the partition's numel,) back into `optimizer`.

    Raises:
        CheckpointError (MomentumSGD) or ValueError (the outer step): a vector of another length.
    """
    if isinstance(optimizer, PartitionOuterStep):
        if optimizer.outer.kind == "nesterov":  # avg keeps no state
            optimizer.outer.load_buffer(torch.from_numpy(np.array(vector, dtype=np.float32, copy=True)))
        return
    if optimizer.momentum != 0:
        momentum_from_flat(optimizer, vector)


def round_rows(cfg: Any, batch_size: int, num_samples: int) -> int:
    """The rows a worker gets per round of the sharded barrier: ``local_steps`` x `batch_size`, capped
    at the training split's `num_samples` (as the central server's local SGD tasks are); `batch_size`
    with ``local_steps`` 1. `cfg` is a `wiiide.config.RunConfig`."""
    return max(1, min(batch_size * cfg.local_steps, num_samples))


class LocalRounds:
    """A worker's side of sharded local SGD (the module docstring's step 2).

    Args:
        cfg: the run's `wiiide.config.RunConfig` (local_steps, grad_accum_steps, the schedule of the inner
            rate, debug_step_sleep_s).
        model, flat: the worker's model and its `FlatParams`.
        client: the worker's `wiiide.server.ps.client.ShardClient`, attached without hooks.
        kind: the model's type (``mlp``, ``transformer``...: the loss, `wiiide.training.models.loss_mean`).
        rank: the worker's rank (debug_sleep_worker_rank).
        scope: the worker's forward scope (`wiiide.tensor_memory.ForwardScope`: mixed precision's autocast
            and the activation meter); None: plain fp32.
    """

    def __init__(self, cfg: Any, model: nn.Module, flat: FlatParams, client: Any, kind: str, rank: int,
                 scope: Any = None) -> None:
        self.cfg, self.model, self.flat, self.client, self.scope = cfg, model, flat, client, scope
        self.loss_fn = partial(loss_mean, kind)
        self.schedule = LrSchedule.from_config(cfg)
        self.sleep_s = cfg.debug_step_sleep_s if cfg.debug_sleep_worker_rank in (0, rank) else 0.0

    def push_round(self, step: int, x: torch.Tensor, y: torch.Tensor) -> float:
        """H local steps on (x, y) (H pieces of near-equal rows) from the parameters in ``flat``, then
        the model delta pushed for round `step`; ``flat.params`` is back at the pulled parameters when
        this returns. Returns the mean loss over the H steps.

        Raises:
            ProtocolError: the batch does not fit the model or has fewer rows than local_steps.
        """
        pulled = self.flat.params.clone()
        touched, rows = None, self.client.rows
        try:
            if rows is None:
                delta, loss_value = local_delta(self.model, self.flat, x, y, self.cfg.local_steps,
                                                self.schedule.lr(step), self.cfg.grad_accum_steps, self.sleep_s,
                                                loss_fn=self.loss_fn, scope=self.scope)
            else:  # sparse rows: the table's rows by sgd_rows, and the touched ones pushed
                touched, loss_value = rows.local_delta(self.model, self.flat, x, y, self.cfg.local_steps,
                                                       self.schedule.lr(step), self.cfg.grad_accum_steps,
                                                       self.loss_fn, self.scope)
                delta = pulled - self.flat.params
        except (RuntimeError, IndexError, ValueError) as exc:
            raise ProtocolError(f"batch does not fit the model: {exc}") from None
        with torch.no_grad():
            self.flat.grads.copy_(delta)
            self.flat.params.copy_(pulled)  # what the shards' replica holds: the pulls apply to it
        self.client.push_all(step, int(x.shape[0]) if self.cfg.adaptive_batch else None, touched)
        return loss_value

