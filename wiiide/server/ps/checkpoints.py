"""Checkpoints of a sharded parameter server (``ps_shards`` > 1) and their restore (`wiiide.server.checkpoint`).

Writing: every shard writes its own file, ``ps-shard-<i>-step<step>.safetensors`` (`shard_prefix`), in
the run's checkpoint folder (`wiiide.server.recovery.checkpoint_dir`) with the same atomic, hashed writer as the
central server (`wiiide.server.checkpoint.CheckpointStore`): ``params`` and the optimizer's state, each the shard's
partitions concatenated in partition order (float32): ``momentum`` (MomentumSGD's buffer), or with
``local_steps`` > 1 ``outer_momentum`` (the outer step's Nesterov buffer, `wiiide.server.ps.local_sgd.optimizer_state`;
the outer step's anchor is ``params`` itself, ``avg`` keeps no state), at every step that is a multiple of
``checkpoint_every_steps``, and at the steps the coordinator announces (``checkpoint_at``) when
``checkpoint_every_s`` passed. A partition's step counter is the step of the run (every worker pushes
every partition once per step), so each shard takes a copy of a partition right after the update that
brings it to step s, and writes the file once all its partitions reached s. The multiples need no
message; an announced step is one no shard can have reached yet (`announce_step`), and a shard whose
partitions passed it anyway (the announcement overtaken by pushes on other connections) logs that it
missed it: that step is then incomplete and the restore uses another. The run metadata names the shard, the shard count,
the partitions' ``[start, stop)`` bounds and the training knobs (`wiiide.server.recovery.training_identity`).

Paced shards (`wiiide.server.ps.paced`): in rounds (adaptive batches, s = 0) a step is a round, as above. Under
async and a staleness bound a partition's step counts the pushes it applied, and the coordinator makes
the cut consistent by draining: it hands out no task past the checkpoint step N (a multiple, or the
announced step) until every task handed out is reported, so every partition's N-th update is its last
before the cut and every shard's file of step N holds the same N pushes applied. The coordinator's shard
adds the handout to its file's run metadata (`ShardCheckpointer.run_meta`: each worker's SSP clock), which
the restarted coordinator reads back (`ShardsRestored.run`).

Restore (`restore_shards`, called by the restarted coordinator before it sends the plan): the newest step
complete and verified on EVERY shard (`wiiide.server.checkpoint.load_newest_complete`), so the restored shards
are consistent; a shard file that fails its hash (or is missing, truncated, from another plan) makes its
step incomplete and the previous complete step is used, with the reason logged. The coordinator
assembles the full parameter and momentum vectors from the files and sends them with the plan; each
shard takes its partitions from them. The folder must be one the coordinator reads: the run's folder
(local processes, Compose: every node writes to the same bind mount).

Not checkpointed: the error-feedback residuals of lossy pushes and pulls (they restart at zero) and the
training time (``duration_s`` counts from the restart).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from wiiide.server.checkpoint import (
    Checkpoint,
    CheckpointError,
    CheckpointStore,
    load_newest_complete,
)
from wiiide.config import RunConfig
from wiiide.errors import ProtocolError
from wiiide.log import TieredLog
from wiiide.metrics import NodeMetrics, summarize
from wiiide.training.model import MomentumSGD
from wiiide.server.pace.outer import PartitionOuterStep
from wiiide.server.ps.local_sgd import optimizer_state, optimizer_state_name
from wiiide.server.ps.partition import Partition
from wiiide.server.recovery import checkpoint_dir, training_identity

CHECKPOINT_AT = "checkpoint_at"  # coordinator -> shard: {"step": s}, checkpoint when the partitions reach s
MAX_ANNOUNCED = 64  # announced steps a shard keeps at most (one per checkpoint_every_s)


def announce_step(handed_out: int) -> int:
    """The step the coordinator announces for a time-triggered checkpoint when batches of steps below
    `handed_out` are out and the next one is not: a shard's partitions can reach step `handed_out` at most
    (the update of step handed_out - 1), so `handed_out` + 1 is still ahead of every shard, provided the
    announcement reaches it before the pushes of step `handed_out`."""
    return handed_out + 1


def shard_prefix(shard: int) -> str:
    """The file prefix of shard `shard`'s checkpoints: ``ps-shard-<shard>``."""
    return f"ps-shard-{int(shard)}"


def shard_identity(cfg: RunConfig, shard: int, num_shards: int, owned: Sequence[Partition]) -> dict:
    """The run metadata a shard's checkpoint must carry to be restored into this plan: the training knobs,
    the shard, the shard count and its partitions' ``[start, stop)`` bounds in partition order."""
    return {**training_identity(cfg), "shard": shard, "num_shards": num_shards,
            "partitions": [[p.start, p.stop] for p in sorted(owned, key=lambda p: p.index)]}


@dataclass
class ShardsRestored:
    """What the restarted coordinator restores: the step, the full flat float32 vectors (numel,) of the
    parameters and of the shards' optimizer state (`momentum`: MomentumSGD's buffer, or with local_steps
    > 1 the outer step's Nesterov buffer; None when the checkpoints carry none: momentum 0, ``avg``, or
    step 0), the files it read (one per shard, in shard order) and shard 0's run metadata (`run`: a paced
    run's SSP clocks, `ShardCheckpointer.run_meta`)."""

    step: int
    params: np.ndarray
    momentum: np.ndarray | None
    paths: list[str]
    run: dict = field(default_factory=dict)


def restore_shards(cfg: RunConfig, partitions: Sequence[Partition], num_shards: int, numel: int,
                   log: TieredLog) -> tuple[ShardsRestored | None, list[dict[str, str]]]:
    """The newest step complete and verified on every one of `num_shards` shards for this plan, assembled.

    Returns:
        (the restored state or None for a fresh start, the files refused: {"path", "cause"}).
    """
    stores = [CheckpointStore(checkpoint_dir(cfg), shard_prefix(s), cfg.checkpoint_keep, log.error)
              for s in range(num_shards)]
    owned = [[p for p in partitions if p.shard == s] for s in range(num_shards)]
    shapes = [{"params": (sum(p.numel for p in parts),)} for parts in owned]
    runs = [shard_identity(cfg, s, num_shards, parts) for s, parts in enumerate(owned)]
    found = load_newest_complete(stores, shapes, runs, log.error)
    refused = [r for store in stores for r in store.refused]
    if found is None:
        return None, refused
    step, checkpoints = found
    state = optimizer_state_name(cfg)
    try:
        params = _assemble(checkpoints, owned, numel, "params")
        momentum = (_assemble(checkpoints, owned, numel, state)
                    if all(state in c.tensors for c in checkpoints) else None)
    except CheckpointError as exc:  # a momentum of another length: the step cannot be used
        log.error("refused the sharded checkpoint of step %d: %s; starting from step 0", step, exc)
        return None, [*refused, {"path": str(checkpoints[0].path), "cause": str(exc)}]
    return ShardsRestored(step, params, momentum, [str(c.path) for c in checkpoints], checkpoints[0].run), refused


def _assemble(checkpoints: Sequence[Checkpoint], owned: Sequence[Sequence[Partition]], numel: int,
              name: str) -> np.ndarray:
    out = np.zeros(numel, dtype=np.float32)
    for checkpoint, parts in zip(checkpoints, owned):
        values = checkpoint.tensors[name]
        if values.shape != (sum(p.numel for p in parts),):
            raise CheckpointError(f"{checkpoint.path}: {name} of shape {values.shape}, the shard's partitions "
                                  f"hold {sum(p.numel for p in parts)} values")
        at = 0
        for p in sorted(parts, key=lambda p: p.index):
            out[p.start:p.stop] = values[at:at + p.numel]
            at += p.numel
    return out


class ShardCheckpointer:
    """A shard's side: copies each owned partition when it reaches a checkpoint step (`offer`, under the
    shard's lock) and writes the shard's file once every owned partition has (`write`, outside it).

    Args:
        cfg: checkpoint_every_steps (0: never), checkpoint_keep, checkpoint_dir / metrics_dir.
        shard: this shard's id; num_shards: the run's shard count; owned: this shard's partitions.
        metrics: a failed write is a ``checkpoint_failed`` event in it.
        stats: the shard's stats (``metrics.extra["ps"]["shard"]``); ``checkpoints`` goes in it.
        log: a failed write is logged (training goes on, as on the central server).
    """

    def __init__(self, cfg: RunConfig, shard: int, num_shards: int, owned: Sequence[Partition],
                 metrics: NodeMetrics, stats: dict, log: TieredLog) -> None:
        self.every_steps = cfg.checkpoint_every_steps
        self.every_s = cfg.checkpoint_every_s
        self._announced: set[int] = set()
        self.store = CheckpointStore(checkpoint_dir(cfg), shard_prefix(shard), cfg.checkpoint_keep, log.error)
        self.owned = sorted(owned, key=lambda p: p.index)
        self.identity = shard_identity(cfg, shard, num_shards, self.owned)
        self.state_name = optimizer_state_name(cfg)
        # more run metadata for every file (JSON values): the coordinator's shard sets it to a paced run's handout
        self.run_meta: Callable[[], dict] | None = None
        self.metrics, self.log = metrics, log
        self._pending: dict[int, dict[int, tuple[np.ndarray, np.ndarray | None]]] = {}
        self._write_lock = threading.Lock()
        self._write_times_s: list[float] = []
        self.record: dict = {"dir": str(self.store.directory), "every_steps": self.every_steps,
                             "every_s": self.every_s, "written": 0, "prefix": shard_prefix(shard)}
        if self.enabled:
            stats["checkpoints"] = self.record

    @property
    def enabled(self) -> bool:
        """True when checkpoint_every_steps or checkpoint_every_s > 0 and the shard owns a partition."""
        return (self.every_steps > 0 or self.every_s > 0) and bool(self.owned)

    def announce(self, step: object, reached: int) -> bool:
        """The coordinator announced a checkpoint at `step`; `reached`: the highest step of the shard's
        partitions now. Returns False (and logs why) when `step` is not ahead of every partition (one
        passed it uncopied): the shard cannot write it, so that step stays incomplete. Call under the
        shard's lock.

        Raises:
            ProtocolError: `step` is not an integer 1..1e15.
        """
        if type(step) is not int or not 0 < step <= 10**15:  # noqa: E721
            raise ProtocolError(f"{CHECKPOINT_AT}: step must be an integer 1..1e15, got {step!r:.40}")
        if step <= reached:
            self.metrics.event("checkpoint_missed", step=step, reached=reached)
            self.log.error("checkpoint of step %d announced when a partition of this shard had reached it "
                           "(step %d): not written, the restore uses another step", step, reached)
            return False
        self._announced = {s for s in self._announced if s > reached or s in self._pending}
        if len(self._announced) < MAX_ANNOUNCED:
            self._announced.add(step)
        return True

    def offer(self, index: int, step: int, param: np.ndarray,
              optimizer: MomentumSGD | PartitionOuterStep) -> tuple[int, dict[str, np.ndarray]] | None:
        """Partition `index` has just reached `step` (its parameters `param`, float32 (numel,), and its
        optimizer: `wiiide.server.ps.local_sgd.optimizer_state` is saved); copy it if `step` is a checkpoint step. Returns (step, the file's tensors) when every
        owned partition has reached it (then call `write` outside the lock), else None. Call under the
        shard's lock."""
        if not self.enabled or step <= 0:
            return None
        if step not in self._announced and not (self.every_steps and step % self.every_steps == 0):
            return None
        slot = self._pending.setdefault(step, {})
        slot[index] = (param.copy(), optimizer_state(optimizer))
        if len(slot) < len(self.owned):
            return None
        del self._pending[step]
        self._announced.discard(step)
        for older in [s for s in self._pending if s < step]:  # a step that never completed here
            del self._pending[older]
        tensors = {"params": np.concatenate([slot[p.index][0] for p in self.owned])}
        if all(slot[p.index][1] is not None for p in self.owned):
            tensors[self.state_name] = np.concatenate([slot[p.index][1] for p in self.owned])
        return step, tensors

    def write(self, step: int, tensors: dict[str, np.ndarray]) -> None:
        """Write the shard's file of `step` (atomic, hashed: `CheckpointStore.save`). A failed write is
        logged and recorded, never raised: the step stays incomplete and a restore uses an earlier one."""
        with self._write_lock:
            t0 = time.perf_counter()
            try:
                path = self.store.save(step, tensors, {**(self.run_meta() if self.run_meta else {}), **self.identity})
            except (CheckpointError, OSError) as exc:
                self.metrics.event("checkpoint_failed", step=step, cause=f"{type(exc).__name__}: {str(exc)[:200]}")
                self.log.error("shard checkpoint at step %d failed: %s", step, exc)
                return
            self._write_times_s.append(time.perf_counter() - t0)
            self.record.update({"written": self.record["written"] + 1, "last_step": step,
                                "file_bytes": path.stat().st_size, "write_time_s": summarize(self._write_times_s)})
