"""Checkpoints of the central pace server (`wiiide.server.pace.server`) and its resume after a restart.

The pace server writes through the synchronous server's writer (`wiiide.server.recovery.ServerRecovery`, the
atomic, hashed safetensors files of `wiiide.server.checkpoint`; no pickle), at the same intervals
(``checkpoint_every_steps`` counts the server's updates, its versions). A checkpoint holds:

- ``params`` and ``momentum``: the parameters and the optimizer's momentum (gradient pushes);
- ``outer_momentum``: local SGD's outer optimizer state (DiLoCo's Nesterov buffer, `wiiide.server.pace.outer`),
  once it has one (``outer_optimizer: nesterov`` after its first outer step; ``avg`` keeps none);
- the version (updates applied: the checkpoint's step), the training seconds so far and the number of
  tasks handed out (``next_task``: the restarted server numbers its tasks on from it).

What is not saved, and why a resume does not need it: the SSP clocks (`wiiide.server.pace.staleness`) count
pushes of tasks that are gone after a restart. Every worker rejoins on a new connection with no task
in flight and takes the restored parameters, so all start at one clock and the bound holds from the
restart on; an old gap between clocks would only make the first tasks wait for pushes that no longer
exist. For the same reason the SSP cache's and the lossy pulls' record of each worker's copy is
dropped (a new connection gets parameters in full), and adaptive batches re-measure each worker's
throughput. A restored run draws its batches from a stream seeded with seed + version, and the
learning-rate schedule goes on at that version, as the synchronous server does.

The rejoining workers' hints count tasks here (a worker's last step is its last task's id), so the
recovery record has ``tasks_at_crash`` and ``tasks_lost`` where the synchronous server has steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from wiiide.server.pace.outer import OuterOptimizer

OUTER_MOMENTUM = "outer_momentum"


@dataclass(frozen=True)
class PaceResume:
    """Where a pace run starts: `step` (version), `train_s` (training seconds already done, counted
    towards duration_s) and `next_task` (tasks already handed out); all 0 on a fresh start."""

    step: int = 0
    train_s: float = 0.0
    next_task: int = 0


def resume_from(recovery: Any, outer: OuterOptimizer | None) -> PaceResume:
    """The resume point of what `recovery` (`ServerRecovery` or None) restored, and the outer optimizer's
    Nesterov buffer set from its ``outer_momentum`` (the checkpoint's parameters and momentum are
    already loaded: `ServerRecovery.restore`). Marks the recovery's hints as counting tasks."""
    if recovery is None or not recovery.restored_step:
        if recovery is not None:
            recovery.hint_unit = ("tasks", 0)
        return PaceResume()
    buffer = recovery.restored_state.get(OUTER_MOMENTUM)
    if outer is not None and buffer is not None and outer.kind == "nesterov":
        outer.load_buffer(torch.from_numpy(np.array(buffer, dtype=np.float32, copy=True)))
    run = recovery.restored_run
    train_s, next_task = run.get("train_time_s", 0.0), run.get("next_task", 0)
    train_s = float(train_s) if isinstance(train_s, (int, float)) and not isinstance(train_s, bool) else 0.0
    next_task = next_task if isinstance(next_task, int) and not isinstance(next_task, bool) and next_task >= 0 else 0
    recovery.hint_unit = ("tasks", next_task)
    return PaceResume(recovery.restored_step, train_s, next_task)


def checkpoint_after_update(recovery: Any, server: Any, train_time_s: float) -> None:
    """After an update of `server` (`PaceServer`): a checkpoint when one is due (`ServerRecovery.after_step`:
    parameters, momentum, the outer optimizer's buffer, the version and `train_time_s`, the training
    seconds so far), and the recovery figures at the first update after a restart."""
    if recovery is None:
        return
    state = {}
    outer = server.outer
    if outer is not None and outer.buffer is not None:
        state[OUTER_MOMENTUM] = outer.buffer.numpy()
    recovery.after_step(server.version, server.flat, server.optimizer, train_time_s, state=state,
                        run={"next_task": server.next_task})
