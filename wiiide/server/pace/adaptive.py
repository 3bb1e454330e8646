"""Adaptive per-worker batch sizes: each worker's share of a constant global batch follows its measured
samples/s, so that in a synchronous round all workers finish together (the seeds' "adaptive batch
sizing" and "load balancing"; the idea of Chen et al., "Revisiting Distributed Synchronous SGD" 2016,
and of the heterogeneity-aware batch sizing of e.g. Tyagi and Sharma, "Taming Resource Heterogeneity
in Distributed ML Training with Dynamic Batching", 2020).

A worker's rate is the ratio of two exponential moving averages, of the samples and of the seconds of
its tasks (``S = a x samples + (1 - a) x S``, ``T = a x seconds + (1 - a) x T``, rate ``S / T``): a
time-weighted mean. The mean of per-task rates would overstate a worker whose tasks alternate between
fast and stalled ones, as a container at a CPU limit does (the kernel's CFS quota lets it run 25 ms of
every 100 ms period at 0.25 CPU): three 6 ms tasks and one 81 ms task of 256 samples average 32,000
samples/s as rates, while the worker did 1,024 samples in 99 ms, 10,300 samples/s. Sizes are
the global batch split in proportion to the rates by the largest remainder method (Hamilton's
apportionment): floors first, then one more sample to the largest fractional parts, so the sizes are
integers that sum to the global batch exactly; every worker keeps at least `min_batch` samples.

Under a staleness bound the rates alone are not enough: they balance the workers' speeds, not their
clocks, so the clock gap drifts like a random walk until it sits at the bound, and then the fast
workers, which move together, all wait for the slow one at once while the cores idle (measured:
`staleness_bound: 2` with adaptive batches used 1.63 of the 2 cores where async used 1.86). `sizes`
therefore also takes the workers' clocks and scales each weight by ``1 + clock_gain x (clock - mean
clock)`` (clamped to 0.5..2): a worker behind gets a smaller batch and catches up, one ahead a larger
one, a proportional controller on the clock positions on top of the rate balance.
"""

from __future__ import annotations

import math
from typing import Mapping

CLOCK_GAIN = 0.5  # half a batch per clock; measured best of 0, 0.25 and 0.5 (studies/stragglers-clock-gain/stragglers-clock-gain.yaml)
MIN_CLOCK_FACTOR, MAX_CLOCK_FACTOR = 0.5, 2.0


def split_exact(total: int, weights: Mapping[int, float], minimum: int = 1) -> dict[int, int]:
    """`total` split into integers proportional to `weights` (by key), summing to `total` exactly.

    Floors of the exact shares ``total x w / sum(w)`` first (at least `minimum` each), then one sample at
    a time to the largest shortfall (the largest remainder method; ties: lower key), or, when the minimum
    pushed the sum over, one less from the largest excess.
    Weights <= 0 or not finite count as the smallest positive weight given (or all equal when none is).

    Raises:
        ValueError: no keys, or total < minimum x keys.
    """
    if not weights:
        raise ValueError("no workers to split the batch between")
    keys = sorted(weights)
    if total < minimum * len(keys):
        raise ValueError(f"a global batch of {total} cannot give {len(keys)} workers {minimum} sample(s) each")
    good = [w for w in weights.values() if math.isfinite(w) and w > 0]
    floor_w = min(good) if good else 1.0
    w = {k: (weights[k] if math.isfinite(weights[k]) and weights[k] > 0 else floor_w) for k in keys}
    whole = sum(w.values())
    quotas = {k: total * w[k] / whole for k in keys}
    sizes = {k: max(minimum, int(math.floor(quotas[k]))) for k in keys}
    while sum(sizes.values()) < total:  # one more to the largest shortfall (remainder), ties: lower key
        k = min(keys, key=lambda k: (sizes[k] - quotas[k], k))
        sizes[k] += 1
    while sum(sizes.values()) > total:  # the minimum pushed the sum over: one less from the largest excess
        k = min((k for k in keys if sizes[k] > minimum), key=lambda k: (quotas[k] - sizes[k], k))
        sizes[k] -= 1
    return sizes


class AdaptiveBatch:
    """Per-worker batch sizes from measured samples/s, the global batch constant.

    Args:
        global_batch: samples per round over all workers (``num_workers x batch_size``).
        smoothing: the EMA weight of a new task's samples and seconds, in (0, 1] (1: the last task only;
            0.1: about the last ten tasks, long enough to span a CPU quota period of short tasks).
        min_batch: the fewest samples a worker is given (>= 1).
        clock_gain: the fraction of its batch a worker gains per clock ahead of the mean clock (loses per
            clock behind) when `sizes` is given the clocks; 0: rates only.

    A worker not yet measured counts at the mean of the measured rates (all equal before any
    measurement: an even split).

    Raises:
        ValueError: global_batch < 1, smoothing outside (0, 1], min_batch < 1, clock_gain < 0.
    """

    def __init__(self, global_batch: int, smoothing: float = 0.1, min_batch: int = 1,
                 clock_gain: float = CLOCK_GAIN) -> None:
        if global_batch < 1 or not 0 < smoothing <= 1 or min_batch < 1 or not clock_gain >= 0:
            raise ValueError(f"global_batch >= 1, smoothing in (0, 1], min_batch >= 1 and clock_gain >= 0, got "
                             f"{global_batch}, {smoothing}, {min_batch}, {clock_gain}")
        self.global_batch, self.smoothing, self.min_batch = global_batch, smoothing, min_batch
        self.clock_gain = clock_gain
        self._samples_seconds: dict[int, tuple[float, float]] = {}  # rank -> (EMA of samples, EMA of seconds)

    @property
    def rates_samples_per_s(self) -> dict[int, float]:
        """Each measured worker's smoothed rate (samples/s): EMA of samples / EMA of seconds."""
        return {rank: samples / seconds for rank, (samples, seconds) in self._samples_seconds.items()}

    def observe(self, rank: int, samples: int, seconds: float) -> None:
        """Record that `rank` took `seconds` (> 0; the pace server passes the worker's own compute time,
        else send to receive) for `samples` samples; ignores seconds <= 0."""
        if seconds <= 0 or samples <= 0:
            return
        old = self._samples_seconds.get(rank)
        a = self.smoothing
        self._samples_seconds[rank] = ((float(samples), seconds) if old is None
                                       else (a * samples + (1 - a) * old[0], a * seconds + (1 - a) * old[1]))

    def sizes(self, ranks: list[int] | set[int], clocks: Mapping[int, int] | None = None) -> dict[int, int]:
        """The batch size of each of `ranks` (the live workers): sums to global_batch.

        `clocks` (rank -> pushes so far; the SSP clocks, given under a staleness bound): each weight is
        scaled by ``clip(1 + clock_gain x (clock - mean of the ranks' clocks), 0.5, 2)``.

        Raises:
            ValueError: no ranks, or a global batch too small to give each min_batch.
        """
        rates = self.rates_samples_per_s
        known = [rates[r] for r in ranks if r in rates]
        default = sum(known) / len(known) if known else 1.0
        weights = {r: rates.get(r, default) for r in ranks}
        if clocks is not None and self.clock_gain and weights:
            mean_clock = sum(clocks[r] for r in weights) / len(weights)
            for r in weights:
                weights[r] *= min(MAX_CLOCK_FACTOR, max(MIN_CLOCK_FACTOR,
                                                        1.0 + self.clock_gain * (clocks[r] - mean_clock)))
        return split_exact(self.global_batch, weights, self.min_batch)
