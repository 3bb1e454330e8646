"""The central parameter server's checkpoints and its recovery after a restart (`wiiide.server.checkpoint`).

`ServerRecovery` is what the coordinator calls: `restore` once before training (the newest checkpoint
that verifies, if any: parameters, momentum buffers, steps and training time so far), `after_step`
after every step (writes a checkpoint when `checkpoint_every_steps` / `checkpoint_every_s` say so), and
`note_rejoin` for every worker that joins a restarted coordinator with its ``rejoin`` hint. It
records, under ``checkpoints`` and ``recovery`` in the coordinator's metrics:

- ``restored_step``: the step of the checkpoint restored (0 on a fresh start);
- ``steps_at_crash``: the rejoining workers' highest ``last_step`` + 1, i.e. the steps the killed
  coordinator had applied or was applying when it died (it is exact to one step: the last gradient a
  worker sent may or may not have been applied), and at least ``restored_step`` (a shard writes its
  file before it answers the pulls, so the newest complete step on disk can be one no worker saw);
- ``steps_lost`` = steps_at_crash - restored_step (>= 0);
- under the pace server (`wiiide.server.pace.checkpoints`) a worker's ``last_step`` is the id of its last task, so
  these two are ``tasks_at_crash`` and ``tasks_lost`` (tasks handed out by the killed coordinator after
  the restored checkpoint's, i.e. work handed out again);
- ``recovery_s``: from the old coordinator's last sign of life, the latest ``last_params_unix_s``
  (wall-clock time a worker last received parameters from it, at most the kill's instant) to the end
  of the first step after the restart, in wall-clock seconds (the nodes share the host's clock); an
  upper bound of "kill to next step" by the interval between two steps;
- ``process_start_to_first_step_s``: the part of it the restarted process took (start-up, restore,
  the workers' rejoin); the rest is the time until something restarted it.

Incarnations: every start appends one line to ``<metrics_dir>/coordinator.starts.jsonl`` (so a start
that is later SIGKILLed still leaves a trace); a ``coordinator.json`` left by an earlier incarnation
(which exited, e.g. with an error, before being restarted) is moved to
``<metrics_dir>/incarnations/coordinator.<n>.json`` rather than overwritten.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch

from wiiide.server.checkpoint import CheckpointError, CheckpointSchedule, CheckpointStore
from wiiide.config import RunConfig
from wiiide.errors import ProtocolError
from wiiide.log import TieredLog
from wiiide.metrics import NodeMetrics, summarize
from wiiide.training.model import FlatParams, MomentumSGD

STARTS_FILE = "coordinator.starts.jsonl"
INCARNATIONS_DIR = "incarnations"
MAX_HINT_STEP = 10**15
# The knobs the parameters and momentum depend on: a checkpoint written under other values is refused.
TRAINING_KNOBS = ("dataset", "synthetic_samples", "synthetic_features", "synthetic_classes", "test_fraction",
                  "hidden_sizes", "learning_rate", "lr_schedule", "lr_warmup_steps", "lr_decay_steps", "lr_min_ratio",
                  "momentum", "seed")
# Local SGD's outer step keeps state of its own (`wiiide.server.pace.outer`): a checkpoint of a local-SGD run also
# carries these, and only a run with the same values restores it.
OUTER_KNOBS = ("outer_optimizer", "outer_momentum")


def checkpoint_dir(cfg: RunConfig) -> Path:
    """`cfg.checkpoint_dir`, or ``<metrics_dir>/../checkpoints`` when it is empty (in containers
    /results/checkpoints: the run's folder on the host, which a restarted container sees again)."""
    return Path(cfg.checkpoint_dir) if cfg.checkpoint_dir else Path(cfg.metrics_dir).parent / "checkpoints"


def training_identity(cfg: RunConfig) -> dict[str, Any]:
    """The `TRAINING_KNOBS` of `cfg` as JSON values, stored in every checkpoint and required on restore."""
    values = cfg.to_dict()
    identity: dict[str, Any] = {"config": {name: values[name] for name in TRAINING_KNOBS}}
    if cfg.local_steps > 1:  # the outer optimizer's state (DiLoCo's Nesterov momentum) is in the checkpoint
        identity["outer"] = {name: values[name] for name in OUTER_KNOBS}
    return identity


def momentum_to_flat(optimizer: MomentumSGD, flat: FlatParams | None = None) -> np.ndarray | None:
    """The optimizer's momentum buffers as one float32 vector (one value per parameter element, in
    parameter order: `flat.numel` values for the model's optimizer, a partition's for a shard's), or
    None when it keeps none (momentum 0, or before its first step). `flat` is not read."""
    buffers = [optimizer.momentum_buffers.get(i) for i in range(len(optimizer.params))]
    if optimizer.momentum == 0 or any(b is None for b in buffers):
        return None
    return torch.cat([b.detach().reshape(-1) for b in buffers]).numpy().astype(np.float32, copy=True)


def momentum_from_flat(optimizer: MomentumSGD, vector: np.ndarray) -> None:
    """Set the optimizer's momentum buffers from `momentum_to_flat`'s vector (float32, one value per
    parameter element, in parameter order).

    Raises:
        CheckpointError: the vector's length is not the parameters' element count.
    """
    total = sum(p.numel() for p in optimizer.params)
    if vector.shape != (total,):
        raise CheckpointError(f"momentum of shape {vector.shape}, the model needs ({total},)")
    offset = 0
    for i, p in enumerate(optimizer.params):
        n = p.numel()
        optimizer.momentum_buffers[i] = torch.from_numpy(vector[offset:offset + n].copy()).view_as(p)
        offset += n


def rejoin_hint(meta: Mapping[str, Any]) -> dict[str, float] | None:
    """A worker hello's ``rejoin`` hint, checked: ``{"last_step": int 0..1e15, "last_params_unix_s":
    finite float}``; None when the hello has none.

    Raises:
        ProtocolError: a hint of the wrong shape or type (the handshake refuses the connection).
    """
    hint = meta.get("rejoin")
    if hint is None:
        return None
    if not isinstance(hint, dict):
        raise ProtocolError("hello: 'rejoin' must be an object")
    step, seen = hint.get("last_step"), hint.get("last_params_unix_s")
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MAX_HINT_STEP:
        raise ProtocolError(f"hello: rejoin.last_step must be an integer 0..{MAX_HINT_STEP}")
    if isinstance(seen, bool) or not isinstance(seen, (int, float)) or not 0 <= seen < 1e11:
        raise ProtocolError("hello: rejoin.last_params_unix_s must be seconds since the epoch")
    return {"last_step": step, "last_params_unix_s": float(seen)}


def start_incarnation(metrics_dir: str | Path) -> int:
    """Record this coordinator start and return its number (1 for the first start in `metrics_dir`);
    move a ``coordinator.json`` an earlier incarnation wrote to ``incarnations/coordinator.<n>.json``.

    Raises:
        OSError: the folder cannot be written.
    """
    folder = Path(metrics_dir)
    folder.mkdir(parents=True, exist_ok=True)
    starts = folder / STARTS_FILE
    previous = starts.read_text().count("\n") if starts.exists() else 0
    with open(starts, "a", encoding="utf-8") as fh:
        fh.write(json.dumps({"incarnation": previous + 1, "pid": os.getpid(), "started_unix_s": time.time()}) + "\n")
    old = folder / "coordinator.json"
    if previous and old.exists():
        target = folder / INCARNATIONS_DIR / f"coordinator.{previous}.json"
        target.parent.mkdir(exist_ok=True)
        os.replace(old, target)
    return previous + 1



def process_age_s() -> float | None:
    """Seconds since this process started (float), to a clock tick (10 ms): the kernel's start time of
    the process in ticks since boot (``/proc/self/stat``, field 22, proc(5)) against ``CLOCK_BOOTTIME``.
    Not psutil's ``create_time()``: that adds ``/proc/stat``'s boot time, a whole second, and compares
    it with the wall clock, which put it 60-80 ms (up to a second) off here. None where there is no
    ``/proc`` (not Linux)."""
    try:
        with open("/proc/self/stat", "rb") as f:
            stat = f.read()
        start_ticks = int(stat[stat.rfind(b")") + 2:].split()[19])  # fields from the 3rd, after "(comm)"
        return time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None

class ServerRecovery:
    """Checkpoints of the coordinator's parameters and momentum, and its restore after a restart.

    Args:
        cfg: checkpoint_every_steps / checkpoint_every_s (both 0: no checkpoint written or restored),
            checkpoint_dir (`checkpoint_dir`), checkpoint_keep, metrics_dir (incarnations).
        metrics: the coordinator's; ``checkpoints`` and ``recovery`` go into its ``extra``.
        log: errors (refused checkpoints, failed writes) and info lines.
    """

    def __init__(self, cfg: RunConfig, metrics: NodeMetrics, log: TieredLog) -> None:
        self.cfg, self.metrics, self.log = cfg, metrics, log
        self.schedule = CheckpointSchedule(cfg.checkpoint_every_steps, cfg.checkpoint_every_s)
        self.store = CheckpointStore(checkpoint_dir(cfg), "coordinator", cfg.checkpoint_keep, log.error)
        self.incarnation = start_incarnation(cfg.metrics_dir)
        self.restored_step = 0
        # the restored checkpoint's other per-parameter state (name -> float32, flat.numel; e.g. the pace
        # server's outer momentum) and its run metadata, for whoever owns that state to take
        self.restored_state: dict[str, np.ndarray] = {}
        self.restored_run: dict[str, Any] = {}
        # what the workers' rejoin hints count (their last_step): steps, or for the pace server the tasks
        # it hands out ("tasks", and the restored checkpoint's count of tasks handed out)
        self.hint_unit: tuple[str, int | None] = ("steps", None)
        self._hints: list[dict[str, float]] = []
        self._write_times_s: list[float] = []
        self._written = 0
        self._bytes = 0
        self._first_step_done = False
        self.recovery: dict[str, Any] = {"incarnation": self.incarnation, "restored_step": 0, "restored_from": None,
                                         "refused": self.store.refused}
        metrics.extra["recovery"] = self.recovery
        if self.schedule.enabled:
            metrics.extra["checkpoints"] = {"dir": str(self.store.directory), "every_steps": cfg.checkpoint_every_steps,
                                            "every_s": cfg.checkpoint_every_s, "written": 0}

    @property
    def enabled(self) -> bool:
        """True when checkpoints are on (either interval > 0)."""
        return self.schedule.enabled

    def restore(self, flat: FlatParams, optimizer: MomentumSGD) -> tuple[int, float]:
        """Load the newest checkpoint that verifies into `flat` and `optimizer`.

        Tensors other than ``params`` and ``momentum`` (state the pace server keeps, `after_step`'s
        `state`) must hold flat.numel values too; they are kept in `restored_state`, the run metadata in
        `restored_run`.

        Returns:
            (steps applied, training seconds so far) of the restored checkpoint; (0, 0.0) when
            checkpoints are off or none verifies (a fresh start).
        """
        if not self.enabled:
            return 0, 0.0
        shapes = {"params": (flat.numel,)}
        checkpoint = self.store.load_newest(shapes, training_identity(self.cfg))
        if checkpoint is None:
            if self.store.refused:
                self.log.error("no checkpoint in %s verifies (%d refused); starting from step 0",
                               self.store.directory, len(self.store.refused))
            return 0, 0.0
        try:
            momentum = checkpoint.tensors.get("momentum")
            for name, array in checkpoint.tensors.items():
                if name not in ("params", "momentum") and array.shape != (flat.numel,):
                    raise CheckpointError(f"{name} of shape {array.shape}, the model needs ({flat.numel},)")
            if momentum is not None:
                momentum_from_flat(optimizer, momentum)
        except CheckpointError as exc:
            self.store.refused.append({"path": str(checkpoint.path), "cause": str(exc)})
            self.log.error("refused checkpoint %s: %s; starting from step 0", checkpoint.path, exc)
            return 0, 0.0
        flat.load(torch.from_numpy(checkpoint.tensors["params"]))
        self.restored_state = {k: v for k, v in checkpoint.tensors.items() if k not in ("params", "momentum")}
        self.restored_run = dict(checkpoint.run)
        train_s = checkpoint.run.get("train_time_s")
        train_s = float(train_s) if isinstance(train_s, (int, float)) and not isinstance(train_s, bool) else 0.0
        self.mark_restored(checkpoint.step, str(checkpoint.path), train_s)
        return checkpoint.step, train_s

    def mark_restored(self, step: int, source: str, train_s: float = 0.0, **extra: Any) -> None:
        """Record that the state of `step` was restored from `source` (a file, or a sharded checkpoint's
        description), with `train_s` training seconds so far; `extra` goes into ``recovery`` too."""
        self.restored_step = step
        self.schedule.mark(step, time.monotonic())
        self.recovery.update({"restored_step": step, "restored_from": source, "restored_train_time_s": train_s,
                              "restored_at_unix_s": time.time(), **extra})
        self.metrics.steps = step
        self.metrics.event("checkpoint_restored", step=step, path=source, incarnation=self.incarnation)
        self.log.info("restored checkpoint %s: step %d (incarnation %d)", Path(source).name, step, self.incarnation)

    def note_rejoin(self, hint: dict[str, float] | None) -> None:
        """Keep a joining worker's ``rejoin`` hint (`rejoin_hint`) for the steps-lost and recovery figures."""
        if hint is not None:
            self._hints.append(hint)

    def after_step(self, step: int, flat: FlatParams, optimizer: MomentumSGD, train_time_s: float,
                   state: Mapping[str, np.ndarray] | None = None, run: Mapping[str, Any] | None = None) -> None:
        """After `step` steps: the recovery figures at the first step of a restored run, and a checkpoint
        when one is due. A failed write is logged and recorded, never fatal (training goes on).

        `state`: more per-parameter state to save beside ``params`` and ``momentum`` (name -> float32,
        flat.numel values; `restore` checks the length and keeps it in `restored_state`); `run`: more
        JSON run metadata (`restored_run`)."""
        self.note_step(step)
        if not self.schedule.due(step, time.monotonic()):
            return
        tensors = {"params": flat.params.numpy(), **(state or {})}
        momentum = momentum_to_flat(optimizer, flat)
        if momentum is not None:
            tensors["momentum"] = momentum
        run = {**(run or {}), "train_time_s": train_time_s, "incarnation": self.incarnation, "node_id": self.metrics.node_id,
               **training_identity(self.cfg)}
        t0 = time.perf_counter()
        try:
            path = self.store.save(step, tensors, run)
        except (CheckpointError, OSError) as exc:
            self.metrics.event("checkpoint_failed", step=step, cause=f"{type(exc).__name__}: {str(exc)[:200]}")
            self.log.error("checkpoint at step %d failed: %s", step, exc)
            self.schedule.mark(step, time.monotonic())  # retry at the next interval, not at every step
            return
        self._write_times_s.append(time.perf_counter() - t0)
        self._written += 1
        self._bytes = path.stat().st_size
        self.schedule.mark(step, time.monotonic())
        self.metrics.extra["checkpoints"].update({"written": self._written, "last_step": step,
                                                  "file_bytes": self._bytes,
                                                  "write_time_s": summarize(self._write_times_s)})

    def note_step(self, step: int) -> None:
        """After `step` steps: at the first step of this incarnation, the recovery figures (steps lost,
        recovery time) when it restored a checkpoint or workers rejoined it. The sharded servers
        (`wiiide.server.ps.session`), which write their own checkpoints, call this alone."""
        if self._first_step_done:
            return
        self._first_step_done = True
        if not self.restored_step and not self._hints:
            return
        now = time.time()
        if self._hints:
            at_crash = max(int(h["last_step"]) for h in self._hints) + 1
            last_seen = max(h["last_params_unix_s"] for h in self._hints)
            unit, base = self.hint_unit
            if base is None:  # steps: on the sharded servers a shard writes its file before it answers the
                at_crash = max(at_crash, self.restored_step)  # pulls, so a step no worker saw can be on disk
            self.recovery.update({
                f"{unit}_at_crash": at_crash, f"{unit}_lost": max(0, at_crash - (self.restored_step if base is None
                                                                                  else base)),
                "recovery_s": round(now - last_seen, 6), "workers_rejoined": len(self._hints)})
        self.recovery["first_step_unix_s"] = now
        age_s = process_age_s()  # of the recovery time, what the restarted process itself took
        if age_s is not None:
            self.recovery["process_start_to_first_step_s"] = round(age_s, 3)
        unit = self.hint_unit[0]
        self.metrics.event("recovered", **{k: self.recovery.get(k) for k in
                                           ("restored_step", f"{unit}_at_crash", f"{unit}_lost", "recovery_s")})
        self.log.info("recovered: restored step %d, %s %s lost, %s s from the old coordinator's last step",
                      self.restored_step, self.recovery.get(f"{unit}_lost"), unit, self.recovery.get("recovery_s"))
