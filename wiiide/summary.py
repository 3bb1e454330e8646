"""The Training Summary of the DDP/FSDP benchmarking guide (seed document 003), for any node of any engine.

The guide prints, after a run::

    num_steps, avg_step_time, min_step_time, max_step_time, throughput_samples_per_sec,
    avg_loss, final_loss, peak_memory_allocated, avg_memory_allocated

and excludes warm-up steps (10-50) from the timings. Here memory is the process's resident set size
(CPU: no allocator statistics), and names carry units. Throughput is the guide's formula,
``batch_size x world_size / step_time``, i.e. samples of one synchronous step over the mean step time.
"""

from __future__ import annotations

import statistics
from typing import Any, Iterable, Sequence


def training_summary(step_times_s: Sequence[float], losses: Sequence[float], warmup_steps: int,
                     samples_per_step: float | None, rss_samples_bytes: Sequence[int],
                     peak_rss_bytes: int | None, tokens_per_sample: int | None = None) -> dict[str, Any]:
    """The guide's Training Summary of one node.

    Args:
        step_times_s: seconds of every step, in order (warm-up steps included; they are dropped here).
        losses: the loss of every step (all steps count for ``avg_loss``; ``final_loss`` is the last).
        warmup_steps: how many first steps to leave out of the timings.
        samples_per_step: samples one step trains on across the cluster (the global batch); None: unknown.
        rss_samples_bytes: resident set sizes sampled during the run (bytes).
        peak_rss_bytes: the node's peak RSS (bytes), None if unknown.
        tokens_per_sample: tokens (bytes) a sample holds, for a language model (its context); None or 1:
            ``throughput_tokens_per_s`` is left out (a classifier's sample is not made of tokens).

    Returns:
        ``num_steps`` (timed steps, after warm-up), ``warmup_steps`` (left out), ``total_steps``,
        ``avg/min/max/median/stdev_step_time_s``, ``throughput_samples_per_s``, ``avg_loss``, ``final_loss``,
        ``peak_rss_bytes``, ``avg_rss_bytes``, and for a language model ``throughput_tokens_per_s``
        (samples/s x tokens per sample). Timing fields are None when every step was a warm-up step.
    """
    total = len(step_times_s)
    skipped = min(max(0, int(warmup_steps)), total)
    timed = [float(t) for t in step_times_s[skipped:]]
    avg = statistics.fmean(timed) if timed else None
    samples_per_s = (samples_per_step / avg) if (samples_per_step and avg) else None
    tokens = {}
    if tokens_per_sample and tokens_per_sample > 1:
        tokens = {"tokens_per_sample": tokens_per_sample,
                  "throughput_tokens_per_s": samples_per_s * tokens_per_sample if samples_per_s else None}
    return {
        "num_steps": len(timed),
        "warmup_steps": skipped,
        "total_steps": total,
        "avg_step_time_s": avg,
        "min_step_time_s": min(timed) if timed else None,
        "max_step_time_s": max(timed) if timed else None,
        "median_step_time_s": statistics.median(timed) if timed else None,
        "stdev_step_time_s": statistics.stdev(timed) if len(timed) > 1 else (0.0 if timed else None),
        "samples_per_step": samples_per_step,
        "throughput_samples_per_s": samples_per_s,
        **tokens,
        "avg_loss": statistics.fmean(losses) if losses else None,
        "final_loss": float(losses[-1]) if losses else None,
        "peak_rss_bytes": peak_rss_bytes,
        "avg_rss_bytes": statistics.fmean(rss_samples_bytes) if rss_samples_bytes else None,
    }


def format_summary(summary: dict[str, Any]) -> str:
    """The summary as the guide prints it: a title, a rule, then ``key: value`` lines."""
    lines = ["Training Summary", "=" * 50]
    for key, value in summary.items():
        lines.append(f"{key}: {value:.6g}" if isinstance(value, float) else f"{key}: {value}")
    return "\n".join(lines)


def summarize(values: Iterable[float]) -> dict[str, float | int | None]:
    """count, mean, stdev, median, min, max, p95 of raw values (stdev 0 for one value; None if empty)."""
    data = sorted(float(v) for v in values)
    n = len(data)
    if n == 0:
        return {"count": 0, "mean": None, "stdev": None, "median": None, "min": None, "max": None, "p95": None}
    return {
        "count": n,
        "mean": statistics.fmean(data),
        "stdev": statistics.stdev(data) if n > 1 else 0.0,
        "median": statistics.median(data),
        "min": data[0],
        "max": data[-1],
        "p95": data[min(n - 1, int(round(0.95 * (n - 1))))],
    }
