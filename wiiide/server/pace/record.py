"""What a run at its own pace records: per-worker pushes, batches and samples, the staleness of every
applied update (a histogram), the clock gap between the fastest and the slowest worker, and every
worker's batch size over time. `PaceRecord.to_extra` gives the JSON-ready dict the coordinator puts in
its metrics (``extra``); `harness.results.totals` copies it into the report.
"""

from __future__ import annotations

from collections import Counter
from typing import Any


class PaceRecord:
    """Counters of one run (ranks are ints; times are seconds since training started)."""

    def __init__(self) -> None:
        self.staleness: Counter[int] = Counter()
        self.pushes: Counter[int] = Counter()
        self.samples: Counter[int] = Counter()
        self.gap_max = 0
        self._gap_sum = 0
        self._gap_count = 0
        self.batch_sizes: dict[int, list[list[float]]] = {}

    def applied(self, rank: int, staleness: int, samples: int) -> None:
        """An update of `rank` over `samples` samples was applied `staleness` versions after it was read."""
        self.staleness[staleness] += 1
        self.pushes[rank] += 1
        self.samples[rank] += samples

    def clock_gap(self, gap: int) -> None:
        """The clock gap (fastest - slowest live worker) after an update."""
        self.gap_max = max(self.gap_max, gap)
        self._gap_sum += gap
        self._gap_count += 1

    def batch_size(self, rank: int, t_s: float, size: int) -> None:
        """`rank` was given `size` samples per batch at `t_s`; kept only when it changed (change points)."""
        points = self.batch_sizes.setdefault(rank, [])
        if not points or points[-1][1] != size:
            points.append([round(t_s, 3), size])

    def to_extra(self) -> dict[str, Any]:
        """The metrics' ``extra`` entries: ``staleness_histogram`` {k: updates}, ``staleness_max``,
        ``staleness_mean`` (None without updates), ``clock_gap_max``/``clock_gap_mean`` (clocks),
        ``pushes_per_worker``, ``samples_per_worker`` {rank: count} and ``batch_sizes_per_worker``
        {rank: [[t_s, size], ...]} (change points)."""
        total = sum(self.staleness.values())
        return {
            "staleness_histogram": {str(k): v for k, v in sorted(self.staleness.items())},
            "staleness_max": max(self.staleness) if total else None,
            "staleness_mean": sum(k * v for k, v in self.staleness.items()) / total if total else None,
            "clock_gap_max": self.gap_max,
            "clock_gap_mean": self._gap_sum / self._gap_count if self._gap_count else None,
            "pushes_per_worker": {str(r): n for r, n in sorted(self.pushes.items())},
            "samples_per_worker": {str(r): n for r, n in sorted(self.samples.items())},
            "batch_sizes_per_worker": {str(r): pts for r, pts in sorted(self.batch_sizes.items())},
        }


def pace_extra(server: Any) -> dict[str, Any]:
    """The metrics' ``extra`` entries of a finished pace run (`wiiide.server.pace.server.PaceServer`): its
    `PaceRecord`'s, the epochs, the learning rates applied (`wiiide.lr_schedule.LrRecord`) and under
    ``pace`` the pacing knobs, the tasks sent with and without parameters, the updates and (local SGD
    with lossy pulls) what the workers' copies owe, (sparse rows) the pulls of rows."""
    cfg = server.cfg
    extra = {"epochs": server.sampler.epochs_done, **server.record.to_extra(), **server.lrs.to_dict(),
             "lr_applied_by": "worker inner steps" if server.outer else "server"}
    extra["pace"] = {"staleness_bound": cfg.staleness_bound, "local_steps": cfg.local_steps,
                     "ssp_cache": cfg.ssp_cache, "tasks_with_params": server.params_sent,
                     "tasks_without_params": server.params_skipped,
                     "outer_optimizer": cfg.outer_optimizer if cfg.local_steps > 1 else None,
                     "staleness_scaling": cfg.staleness_scaling, "adaptive_batch": cfg.adaptive_batch,
                     "grad_accum_steps": cfg.grad_accum_steps, "updates": server.version,
                     "restored_step": server.resume.step}
    if server.rows is not None:  # sparse rows: tasks with the changed rows, and the rows a pull carried
        extra["pace"]["sparse_rows"] = server.rows.record()
    if server.pulls is not None:  # what the workers' copies owe, and the codecs of the pulls
        extra["pace"]["pulls"] = {
            "frames_encoded": server.pulls.frames_encoded, "choices": server.pulls.policy.record["choices"],
            "replica_max_abs_gap": server.pulls.max_abs_gap(server.flat.params.numpy())}
    return extra
