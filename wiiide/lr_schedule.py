"""Learning-rate schedules: the rate of optimizer step ``t`` as a pure function of ``t``.

One schedule serves every engine and pacing (``docs/training.md``): the central server and each
parameter-server shard set their `wiiide.training.model.MomentumSGD`'s ``lr`` to `LrSchedule.lr` before
every step, the pace server does the same per update (and hands local SGD's workers the inner rate
of their task), and DDP/FSDP wrap `LrSchedule.factor` in ``torch.optim.lr_scheduler.LambdaLR``.

The shape (``lr_schedule``, with ``W`` = ``lr_warmup_steps``, ``D`` = the decay's length in steps,
``m`` = ``lr_min_ratio``, ``t`` = optimizer steps already taken, 0-based)::

    warm-up   t < W:          factor = t / W                  (linear from 0: step 0 trains at rate 0)
    decay     W <= t < W + D: p = (t - W) / D
              constant:       factor = 1
              linear:         factor = 1 - (1 - m) p
              cosine:         factor = m + (1 - m) (1 + cos(pi p)) / 2
    after     t >= W + D:     factor = m (linear, cosine), 1 (constant)

and ``lr(t) = learning_rate x factor(t)``. This is torch's ``LinearLR`` warm-up (from a start factor of
0, which torch itself does not allow) followed by ``LinearLR(1, m, D)`` or ``CosineAnnealingLR(D,
eta_min = m x learning_rate)`` held at its minimum (torch's cosine would rise again past ``T_max``);
the warm-up from 0 and the hold are Hugging Face's ``get_linear_schedule_with_warmup`` /
``get_cosine_schedule_with_warmup`` (``transformers/optimization.py``), with a floor of ``m``.
``D`` is ``lr_decay_steps``, or ``max_steps - W`` when that is 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from wiiide.errors import ProtocolError

LR_SCHEDULES = ("constant", "linear", "cosine")
LrScheduleKind = Literal["constant", "linear", "cosine"]
MAX_WIRE_LR = 100.0  # learning_rate's upper bound (wiiide.config)


@dataclass(frozen=True)
class LrSchedule:
    """The learning rate of every step (see the module docstring for the formulas).

    Args:
        base_lr: the peak learning rate (``learning_rate``), > 0.
        kind: ``constant`` | ``linear`` | ``cosine``.
        warmup_steps: W >= 0, steps of linear warm-up from 0.
        decay_steps: D >= 0, steps of decay after the warm-up (``linear``/``cosine``: must be > 0).
        min_ratio: m in [0, 1], the rate after the decay as a fraction of `base_lr`.

    Raises:
        ValueError: any argument out of its range, or a decaying kind with ``decay_steps`` 0.
    """

    base_lr: float
    kind: LrScheduleKind = "constant"
    warmup_steps: int = 0
    decay_steps: int = 0
    min_ratio: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in LR_SCHEDULES:
            raise ValueError(f"unknown lr_schedule {self.kind!r}; allowed: {' | '.join(LR_SCHEDULES)}")
        if not self.base_lr > 0 or self.warmup_steps < 0 or self.decay_steps < 0 or not 0 <= self.min_ratio <= 1:
            raise ValueError(f"schedule out of range: base_lr {self.base_lr} (> 0), warmup_steps {self.warmup_steps} "
                             f"(>= 0), decay_steps {self.decay_steps} (>= 0), min_ratio {self.min_ratio} (0..1)")
        if self.kind != "constant" and self.decay_steps == 0:
            raise ValueError(f"lr_schedule {self.kind} needs a decay length: lr_decay_steps > 0, or max_steps "
                             "beyond lr_warmup_steps")

    @classmethod
    def from_config(cls, cfg: Any) -> "LrSchedule":
        """The schedule of a `wiiide.config.RunConfig` (``learning_rate``, ``lr_schedule``,
        ``lr_warmup_steps``, ``lr_decay_steps`` or else ``max_steps - lr_warmup_steps``, ``lr_min_ratio``)."""
        decay = cfg.lr_decay_steps or max(0, cfg.max_steps - cfg.lr_warmup_steps)
        return cls(float(cfg.learning_rate), cfg.lr_schedule, int(cfg.lr_warmup_steps),
                   decay if cfg.lr_schedule != "constant" else 0, float(cfg.lr_min_ratio))

    @property
    def is_constant(self) -> bool:
        """True when every step's rate is `base_lr` (no warm-up, no decay)."""
        return self.kind == "constant" and self.warmup_steps == 0

    def factor(self, step: int) -> float:
        """The multiplier of `base_lr` at optimizer step `step` (0-based; negative counts as 0), in [0, 1]."""
        t = max(0, int(step))
        if t < self.warmup_steps:
            return t / self.warmup_steps
        if self.kind == "constant":
            return 1.0
        progress = min(1.0, (t - self.warmup_steps) / self.decay_steps)
        m = self.min_ratio
        if self.kind == "linear":
            return 1.0 - (1.0 - m) * progress
        return m + (1.0 - m) * 0.5 * (1.0 + math.cos(math.pi * progress))

    def lr(self, step: int) -> float:
        """The learning rate of optimizer step `step`: ``base_lr x factor(step)``."""
        return self.base_lr * self.factor(step)

    def to_dict(self) -> dict[str, Any]:
        """The schedule's parameters for a node's metrics (``lr_schedule``)."""
        return {"kind": self.kind, "base_lr": self.base_lr, "warmup_steps": self.warmup_steps,
                "decay_steps": self.decay_steps, "min_ratio": self.min_ratio}


class LrRecord:
    """The rates a server applied, one per step in step order (``lr_per_step`` in the node's metrics).

    `applied(step, lr)` keeps the first rate of each step: a sharded server's partitions each take
    step ``t`` once, all at the same rate, and only the first is kept. Steps arrive in order from 0
    (or from a restored checkpoint's step, `start_step`).
    """

    def __init__(self, schedule: LrSchedule, start_step: int = 0) -> None:
        self.schedule = schedule
        self.start_step = int(start_step)
        self.lrs: list[float] = []

    def applied(self, step: int, lr: float) -> None:
        """Record that step `step` (0-based) ran at `lr`, if it is the next step not yet recorded."""
        if step - self.start_step == len(self.lrs):
            self.lrs.append(float(lr))

    def to_dict(self) -> dict[str, Any]:
        """``{"lr_schedule": {...parameters, "start_step"}, "lr_per_step": [...]}`` for the node's metrics."""
        return {"lr_schedule": {**self.schedule.to_dict(), "start_step": self.start_step},
                "lr_per_step": list(self.lrs)}


def wire_lr(value: Any, where: str) -> float:
    """A learning rate read from a frame's meta (`where` names the frame in the error): a finite number in
    0..`MAX_WIRE_LR` (0 is a warm-up's first step).

    Raises:
        ProtocolError: anything else (a boolean, a string, NaN, a negative or too large number).
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= float(value) <= MAX_WIRE_LR:
        raise ProtocolError(f"{where}: 'lr' must be a number 0..{MAX_WIRE_LR:g}, got {value!r:.40}")
    return float(value)


__all__ = ["LR_SCHEDULES", "MAX_WIRE_LR", "LrSchedule", "LrRecord", "wire_lr"]
