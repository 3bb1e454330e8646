"""Which nodes host the shards: the ones with the most CPU.

A shard answers a pull of its range to every worker at every step, so a shard on a node with less CPU
than the others sets every worker's pace, whatever the pacing: a container whose CFS quota is spent
stops all its threads (the shard's with the worker's) until the next period (100 ms by default). Each
worker reads its own CPU (`node_cpus`: its cgroup's quota over its period, ``/sys/fs/cgroup/cpu.max``
(cgroup v2), capped by the cores it may run on) and sends it in its hello (``cpus``); the coordinator
(`place_shards`) gives shards 1..k-1 to the workers with the most CPU, ties by rank (equal CPU: the
placement by rank, worker r hosting shard r), shard 0 staying the coordinator's. Under ``ps_shards:
all`` a worker with less than `SHORT_CPU_FRACTION` of the most CPU any worker has hosts none (the run
has fewer shards); an integer ``ps_shards`` keeps its count. The coordinator's metrics carry the choice
as ``ps.placement`` (every worker's ``cpus``, ``hosts``: rank -> shard, ``short_of_cpu``: the ranks left
out).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Iterable

CPU_MAX_PATH = Path("/sys/fs/cgroup/cpu.max")  # cgroup v2: "<quota> <period>" or "max <period>"
CFS_DIR = Path("/sys/fs/cgroup/cpu")  # cgroup v1: cpu.cfs_quota_us (-1: none) and cpu.cfs_period_us
SHORT_CPU_FRACTION = 0.5  # under ps_shards all, a worker below this share of the most CPU hosts no shard
MAX_CPUS = 4096.0  # a hello's cpus above this is refused as malformed


def node_cpus(cpu_max: Path = CPU_MAX_PATH, cfs_dir: Path = CFS_DIR) -> float:
    """This node's CPU in cores: its cgroup's CFS quota over its period (v2 ``cpu.max``: ``"25000 100000"``
    is 0.25; else v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``, as Docker's ``--cpus`` sets them),
    capped by the cores its affinity mask allows (`os.sched_getaffinity`); the cores alone without a
    quota (``max``, -1) or when neither can be read (outside a container)."""
    cores = float(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1))
    for read in (lambda: cpu_max.read_text().split()[:2],
                 lambda: [(cfs_dir / f"cpu.cfs_{name}_us").read_text().strip() for name in ("quota", "period")]):
        try:
            quota, period = read()
            if quota in ("max", "-1"):
                return cores
            if float(quota) > 0 and float(period) > 0:
                return min(cores, float(quota) / float(period))
        except (OSError, ValueError):
            continue
    return cores


def hello_cpus(value: object) -> float | None:
    """A hello's ``cpus`` checked: a finite number in (0, MAX_CPUS], or None when absent. Raises
    ValueError for anything else."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not 0 < value <= MAX_CPUS:
        raise ValueError(f"hello: 'cpus' must be a number in (0, {MAX_CPUS:g}], got {value!r:.40}")
    return float(value)


def place_shards(workers: Iterable[tuple[int, float | None]], k: int, all_nodes: bool) -> dict[int, int]:
    """Which worker hosts which shard: rank -> shard id 1..k'-1 (shard 0 is the coordinator's).

    Args:
        workers: (rank, cpus) of every worker; cpus None (not reported) counts as the most.
        k: the shard count ``ps_shards`` means for these nodes (`wiiide.server.ps.partition.resolve_shards`).
        all_nodes: ``ps_shards: all``: workers short of CPU (below `SHORT_CPU_FRACTION` of the most) host
            none, so k' = 1 + the others; otherwise k' = k.

    The k'-1 workers with the most CPU host, ties by rank, and shard ids follow the ranks of the hosts
    (with equal CPU: worker r hosts shard r, as the placement by rank).
    """
    ranked = sorted(workers, key=lambda w: w[0])
    most = max((c for _, c in ranked if c is not None), default=None)
    cpus = {rank: (c if c is not None else math.inf) for rank, c in ranked}
    eligible = [rank for rank, _ in ranked]
    if all_nodes and most is not None:
        eligible = [rank for rank in eligible if cpus[rank] >= SHORT_CPU_FRACTION * most]
    chosen = sorted(sorted(eligible, key=lambda r: -cpus[r])[:k - 1])
    return {rank: shard for shard, rank in enumerate(chosen, start=1)}
