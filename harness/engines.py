"""Per-repeat figures that put engines side by side: the guide's Training Summary and the communication profile.

Computed from the nodes' own metrics files (every engine writes the same ones: ``coordinator`` is the
parameter server or rank 0) and, for measured bytes, from each node's interface counters, which are
the container's own on the docker backend (the local backend's processes share the host's counters,
so measured bytes are left out there). `harness.report.run_totals` merges these into a repeat's totals.

- ``throughput_samples_per_s``: the guide's ``batch_size x world_size / step time``: the global batch of
  one step over the coordinator's (rank 0's) mean step time, warm-up steps excluded.
- ``comm_expected_bytes_per_step``: `wiiide.engines.comm.estimate`, summed over every node's sends;
  ``comm_bottleneck_expected_bytes_per_step``: sent + received by the busiest node.
- ``comm_measured_bytes_per_step``: bytes sent by every node's interfaces over the run, per step;
  ``comm_measured_over_expected``: their ratio (setup, evaluation, the parameter server's mini-batches
  and protocol framing make it exceed 1).
- ``comm_share``: the share of step time spent communicating. ddp/fsdp: the fraction of rank 0's timed
  steps during which a collective was in flight. wiiide: the fraction of the coordinator's step not
  covered by the workers' own forward/backward (sending parameters and batches, receiving gradients,
  averaging, the optimizer step), i.e. ``1 - mean worker compute per step / coordinator step time``.
"""

from __future__ import annotations

import statistics
from typing import Any

from wiiide.engines.comm import parameter_server


def _measured_on_containers(containers: dict[str, dict[str, Any]]) -> bool:
    return any(c.get("kind") == "container" for c in containers.values())


def engine_totals(nodes: dict[str, dict[str, Any]], containers: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Training Summary and communication figures of one repeat (None where a figure cannot be had)."""
    coord = nodes.get("coordinator") or {}
    workers = [n for name, n in nodes.items() if name.startswith("worker")]
    summary = coord.get("training_summary") or {}
    engine = coord.get("engine") or "wiiide"
    steps = coord.get("steps") or 0
    num_workers = coord.get("num_workers") or len(workers)
    param_bytes = coord.get("gradient_bytes")

    expected = (coord.get("comm") or {}).get("expected")
    if expected is None and engine == "wiiide" and param_bytes and num_workers:
        data_per_step = ((coord.get("payload_bytes_sent") or 0) / steps - num_workers * param_bytes) if steps else 0.0
        expected = parameter_server(param_bytes, num_workers, max(0.0, data_per_step)).to_dict()

    measured = measured_bottleneck = None
    if _measured_on_containers(containers) and steps:
        sent = [n.get("iface_bytes_sent") for n in nodes.values()]
        both = [(n.get("iface_bytes_sent") or 0) + (n.get("iface_bytes_recv") or 0) for n in nodes.values()]
        if sent and all(v is not None for v in sent):
            measured = sum(sent) / steps
            measured_bottleneck = max(both) / steps

    if engine == "wiiide":
        avg_step = (coord.get("step_time_s") or {}).get("mean")
        computes = [(w.get("compute_time_s") or 0) / w["steps"] for w in workers if w.get("steps")]
        comm_share = (max(0.0, 1 - statistics.fmean(computes) / avg_step) if (computes and avg_step) else None)
    else:
        comm_share = (coord.get("comm") or {}).get("share_of_step_time")

    node_summaries = [n.get("training_summary") or {} for n in nodes.values()]
    avg_rss = [s["avg_rss_bytes"] for s in node_summaries if s.get("avg_rss_bytes")]
    peaks = [n.get("peak_rss_bytes") for n in nodes.values() if n.get("peak_rss_bytes")]
    exp_total = expected.get("total_bytes") if expected else None
    return {
        "engine": engine,
        "world_size": coord.get("world_size") or (num_workers + 1 if num_workers else None),
        "timed_steps": summary.get("num_steps"),
        "throughput_samples_per_s": summary.get("throughput_samples_per_s"),
        "step_time_avg_s": summary.get("avg_step_time_s"),
        "step_time_min_s": summary.get("min_step_time_s"),
        "step_time_max_s": summary.get("max_step_time_s"),
        "rss_avg_bytes": statistics.fmean(avg_rss) if avg_rss else None,
        "rss_peak_sum_bytes": sum(peaks) if peaks else None,
        "comm_expected_bytes_per_step": exp_total,
        "comm_bottleneck_expected_bytes_per_step": expected.get("bottleneck_bytes") if expected else None,
        "comm_measured_bytes_per_step": measured,
        "comm_bottleneck_measured_bytes_per_step": measured_bottleneck,
        "comm_measured_over_expected": (measured / exp_total) if (measured is not None and exp_total) else None,
        "comm_share": comm_share,
    }
