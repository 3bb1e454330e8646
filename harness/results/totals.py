"""Per-repeat figures that put engines side by side: the guide's Training Summary and the communication profile.

Computed from the nodes' own metrics files (every engine writes the same ones: ``coordinator`` is the
parameter server or rank 0) and, for measured bytes, from each node's interface counters, which are
the container's own on the docker backend (the local backend's processes share the host's counters,
so measured bytes are left out there). `repeat_totals` is the one place a repeat's `Totals` are built:
the parameter server's figures, the engines' common figures below, and the links stage's figures.

- ``throughput_samples_per_s``: the guide's ``batch_size x world_size / step time``: the global batch of
  one step over the coordinator's (rank 0's) mean step time, warm-up steps excluded.
- ``comm_expected_bytes_per_step``: `wiiide.engines.comm.estimate`, summed over every node's sends;
  ``comm_bottleneck_expected_bytes_per_step``: sent + received by the busiest node.
- ``comm_measured_bytes_per_step``: bytes sent by every node's interfaces over the run, per step;
  ``comm_measured_over_expected``: their ratio (setup, evaluation, the parameter server's mini-batches
  and protocol framing make it exceed 1).
- ``tensor_bytes_max`` / ``activation_bytes_max``: the largest node's tensor memory (parameters,
  gradients, optimizer state and activations, `wiiide.tensor_memory`) and its activations alone, bytes;
  None when no node measured it (a report from before the measurement).
- ``comm_share``: the share of step time spent communicating. ddp/fsdp: the fraction of rank 0's timed
  steps during which a collective was in flight. wiiide: the fraction of the coordinator's step not
  covered by the workers' own forward/backward (sending parameters and batches, receiving gradients,
  averaging, the optimizer step), i.e. ``1 - mean worker compute per step / coordinator step time``.
"""

from __future__ import annotations

import statistics
from typing import Any, Mapping, Sequence

from harness.results.models import HeldOut, Repeat, Stats, Totals
from wiiide.engines.comm import parameter_server
from wiiide.metrics import summarize


def _measured_on_containers(containers: dict[str, dict[str, Any]]) -> bool:
    return any(c.get("kind") == "container" for c in containers.values())


def _engine_figures(nodes: dict[str, dict[str, Any]], containers: dict[str, dict[str, Any]]) -> dict[str, Any]:
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
    tensors = [n["tensor_memory"] for n in nodes.values() if isinstance(n.get("tensor_memory"), dict)]
    exp_total = expected.get("total_bytes") if expected else None
    return {
        "engine": engine,
        "world_size": coord.get("world_size") or (num_workers + 1 if num_workers else None),
        "timed_steps": summary.get("num_steps"),
        "throughput_samples_per_s": summary.get("throughput_samples_per_s"),
        "throughput_tokens_per_s": summary.get("throughput_tokens_per_s"),
        "validation_loss": coord.get("validation_loss"),
        "perplexity": coord.get("perplexity"),
        "rss_peak_max_bytes": max(peaks) if peaks else None,
        "tensor_bytes_max": max((t.get("total_bytes") or 0 for t in tensors), default=None),
        "activation_bytes_max": max((t.get("activation_bytes") or 0 for t in tensors), default=None),
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


# The coordinator's figures of a run at the workers' own pace (wiiide.server.pace.record.PaceRecord.to_extra).
PACE_KEYS = ("samples_per_worker", "pushes_per_worker", "staleness_histogram", "staleness_max", "staleness_mean",
             "clock_gap_max", "clock_gap_mean", "batch_sizes_per_worker")


def _server_figures(nodes: dict[str, dict[str, Any]], containers: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The parameter server's figures: rates over the coordinator's training time, bytes, memory, traffic."""
    coord = nodes.get("coordinator") or {}
    workers = [n for name, n in nodes.items() if name.startswith("worker")]
    train_s = coord.get("train_time_s") or coord.get("wall_time_s") or 0.0
    batches = coord.get("batches") or 0

    def per_s(value: float | None) -> float | None:
        return value / train_s if (value is not None and train_s) else None

    payload = (coord.get("payload_bytes_sent") or 0) + (coord.get("payload_bytes_received") or 0)
    wire = (coord.get("wire_bytes_sent") or 0) + (coord.get("wire_bytes_received") or 0)
    encoded = sum(n.get("encoded_bytes_sent") or 0 for n in nodes.values())
    raw = sum(n.get("payload_bytes_sent") or 0 for n in nodes.values())
    net_times = [n.get("network_time_s") for n in workers if n.get("network_time_s") is not None]
    rx = [c.get("summary", {}).get("net_rx_bytes") for c in containers.values()]
    tx = [c.get("summary", {}).get("net_tx_bytes") for c in containers.values()]
    has_net = any(v is not None for v in rx + tx)
    return {
        "steps": coord.get("steps"),
        "batches": batches,
        "train_time_s": train_s or None,
        "batches_per_s": per_s(batches),
        "samples_per_s": per_s(coord.get("samples")),
        "goodput_bytes_per_s": per_s(payload),
        "wire_bytes_per_s": per_s(wire),
        "test_accuracy": coord.get("test_accuracy"),
        "loss_final": coord.get("loss_final"),
        "loss_avg": coord.get("loss_avg"),
        "step_time_median_s": (coord.get("step_time_s") or {}).get("median"),
        "worker_network_time_s": sum(net_times) / len(net_times) if net_times else None,
        "compression_ratio": raw / encoded if encoded else None,
        "compression_time_s": sum(n.get("compression_time_s") or 0 for n in nodes.values()),
        "peak_rss_bytes": max((n.get("peak_rss_bytes") or 0 for n in nodes.values()), default=None),
        "batches_per_worker": coord.get("batches_per_worker"),
        **{key: coord.get(key) for key in PACE_KEYS},
        "restored_step": (coord.get("recovery") or {}).get("restored_step") or None,
        "steps_lost": _recovery_figure(coord, "steps_lost", sum),
        "recovery_s": _recovery_figure(coord, "recovery_s", max),
        "checkpoints_written": (coord.get("checkpoints") or {}).get("written"),
        "worker_batches_sum": sum(n.get("batches") or 0 for n in workers),
        "container_net_rx_bytes": sum(v or 0 for v in rx) if has_net else None,
        "container_net_tx_bytes": sum(v or 0 for v in tx) if has_net else None,
        "container_net_bytes": sum(v or 0 for v in rx + tx) if has_net else None,
    }


def _recovery_figure(coord: Mapping[str, Any], key: str, combine) -> Any:
    """`key` of a restarted coordinator's ``recovery``, else `combine` (sum, max) of the sharded run's
    worker-loss recoveries' (``ps.recoveries``, `wiiide.server.ps.membership`); None when neither has it."""
    value = (coord.get("recovery") or {}).get(key)
    if value is not None:
        return value
    values = [r[key] for r in (coord.get("ps") or {}).get("recoveries") or [] if r.get(key) is not None]
    return combine(values) if values else None


def _coordinator_record(links: Mapping[str, Any]) -> Mapping[str, Any] | None:
    return next((r for r in (links.get("containers") or {}).values() if r.get("role") == "coordinator"), None)


def _link_figures(links: Mapping[str, Any], nodes: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """Per-repeat link figures ({} for an unshaped run).

    link_rate_bps: the rate in force on the coordinator's egress (the parameter server's link; read
    back from tc). coordinator_egress_utilisation: the coordinator's frame bytes sent per second of
    training over that rate; TCP/IP and Ethernet headers are not counted, so a full link reads
    about 0.95 (1448 payload bytes per 1514-byte frame).
    """
    if not links:
        return {}
    record = _coordinator_record(links)
    rate = record.get("applied_rate_bps") if record else None
    coord = nodes.get("coordinator") or {}
    train_s, sent = coord.get("train_time_s"), coord.get("wire_bytes_sent")
    utilisation = sent * 8 / train_s / rate if (rate and train_s and sent is not None) else None
    return {"link_rate_bps": rate, "coordinator_egress_utilisation": utilisation}


def _held_out_figures(nodes: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """Time to target from the coordinator's (rank 0's) ``held_out`` record ({} without one)."""
    held = (nodes.get("coordinator") or {}).get("held_out")
    if not isinstance(held, Mapping):
        return {}
    return {"time_to_target_s": held.get("time_to_target_s"), "target_reached": held.get("target_reached"),
            "held_out_metric": held.get("metric"), "held_out_target": held.get("target")}


def repeat_held_out(nodes: Mapping[str, Mapping[str, Any]]) -> HeldOut | None:
    """The repeat's held-out curve and time to target (`HeldOut`), from the coordinator's (rank 0's)
    ``held_out`` record (`wiiide.training.evaluation`); None when the run did not evaluate during training.

    Raises:
        pydantic.ValidationError: the record holds a value of the wrong type (a bug in the node).
    """
    held = (nodes.get("coordinator") or {}).get("held_out")
    return HeldOut.model_validate(held) if isinstance(held, Mapping) else None


def repeat_totals(nodes: Mapping[str, Mapping[str, Any]], containers: Mapping[str, Mapping[str, Any]],
                  links: Mapping[str, Any] | None = None) -> Totals:
    """The `Totals` of one repeat, from the run stage's output (`harness.run.backend.RunResult`).

    `nodes`: each node's own metrics (``coordinator``, ``worker-1``...; wiiide.metrics layout);
    `containers`: each container's (or process's) stats record, with ``kind`` and ``summary``;
    `links`: the links stage's record ({} or None for an unshaped run). Figures that cannot be had
    (no coordinator metrics, no container counters, no link) are None. Formulas: the module's
    docstring and `Totals`; rates are per second of the coordinator's training time.

    Raises:
        pydantic.ValidationError: a node's metrics hold a figure of the wrong type (a bug in the node).
    """
    nodes, containers = dict(nodes), dict(containers)
    return Totals(**_server_figures(nodes, containers), **_engine_figures(nodes, containers),
                  **_link_figures(links or {}, nodes), **_held_out_figures(nodes))


# The figures whose statistics over repeats a point keeps (its `summary`), in table order.
SUMMARY_KEYS = ("batches_per_s", "samples_per_s", "goodput_bytes_per_s", "wire_bytes_per_s", "test_accuracy",
                "loss_final", "step_time_median_s", "worker_network_time_s", "compression_ratio", "peak_rss_bytes",
                "container_net_bytes", "throughput_samples_per_s", "step_time_avg_s", "comm_share",
                "comm_measured_bytes_per_step", "rss_avg_bytes", "coordinator_egress_utilisation",
                "time_to_target_s",
                "throughput_tokens_per_s", "validation_loss", "rss_peak_max_bytes", "comm_expected_bytes_per_step",
                "tensor_bytes_max", "activation_bytes_max")


def summary_stats(values: Sequence[float]) -> Stats:
    """count, mean, sample stdev (0 for one value), median, min, max and p95 of raw `values`
    (formulas: `wiiide.metrics.summarize`, on `statistics`); every figure None when `values` is empty."""
    return Stats(**summarize(values))


def point_summary(repeats: Sequence[Repeat]) -> tuple[dict[str, Stats], list[str]]:
    """Statistics of each `SUMMARY_KEYS` figure over the ok repeats that carry it, and the figures
    flagged unstable (stdev above `UNSTABLE_CV` = 10 % of the mean, as pyperf flags them).

    Returns ({figure: Stats}, [unstable figure, ...]); figures no ok repeat carries are left out.
    """
    summary: dict[str, Stats] = {}
    for key in SUMMARY_KEYS:
        values = [r.totals.figure(key) for r in repeats if r.ok]
        values = [v for v in values if v is not None]
        if values:
            summary[key] = summary_stats(values)
    return summary, [key for key, stats in summary.items() if stats.unstable]
