"""The synchronous-round model of a step, set against the steps a sweep measured.

``python -m harness.present.round_model REPORT.json``: one row per point on a rate-limited link, the
model's step time, the measured one (the median over the repeats of each repeat's median step) and
the model's error. The README derives the model ("Link conditions and heterogeneous nodes" for the
central server, "Sharded parameter servers" for ``ps_shards``); here it is for the sharded servers and
DDP, with M the model's bytes, N workers and R the link's TCP payload rate (the htb rate x
`TCP_PAYLOAD_SHARE`):

- sharded (``ps_shards`` > 1): shard j owns s_j bytes (the coordinator's ``ps.shard_loads_bytes``). A
  worker holding shard j sends (M - s_j) of pushes and (N - 1) s_j of pulls back to back; a worker
  without a shard sends M. The coordinator sends N s_0 of pulls, but only once every push of its
  partitions is in: after s_0 / R when its range is pushed first (``partition_balance: pipeline``, the
  tail of the vector, where backward starts), after the push phase, (M - min_j s_j) / R, when it is
  pushed last (``egress`` and ``bytes``: its range is the head). The step is the slowest node's time,
  plus the compute of a step. Each node's bytes are divided by its own compression ratio.
- ddp: ring all-reduce, 2 (W - 1) / W x M / R (gloo; Patarasuk and Yuan 2009), compute overlapped
  with it (buckets) and not added.

Compute of a step: the median over the workers of ``compute_time_s / steps`` (s, wall time of forward
and backward, so CPU contention on a shared machine is in it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence


TCP_PAYLOAD_SHARE = 0.956  # TCP payload per bit of an htb rate with 1500-byte frames (README, "Link conditions")


@dataclass(frozen=True)
class ModelRow:
    """One point: its parameters, the model's step (s), the measured step (s) and the error (model / measured - 1)."""

    params: dict[str, Any]
    model_step_s: float
    measured_step_s: float

    @property
    def error(self) -> float:
        """Relative error of the model against the measurement (negative: the model is faster)."""
        return self.model_step_s / self.measured_step_s - 1.0


def sharded_link_s(shard_loads_bytes: Sequence[float], num_workers: int, rate_bps: float,
                   coordinator_pushed_first: bool, worker_ratio: float = 1.0,
                   coordinator_ratio: float = 1.0) -> float:
    """Seconds the busiest node's link needs per step with sharded servers (see the module's docstring).

    Args:
        shard_loads_bytes: bytes owned by each shard; shard 0 the coordinator's, shard j worker j's.
        num_workers: N >= 1 (workers beyond the shards hold none).
        rate_bps: the link's TCP payload rate, bit/s (> 0).
        coordinator_pushed_first: the coordinator's range is pushed first (``pipeline``) or last.
        worker_ratio, coordinator_ratio: raw / sent bytes of what each sends (>= 1 when compressed).
    Raises:
        ValueError: no shard, no worker, or a rate or ratio <= 0.
    """
    if not shard_loads_bytes or num_workers < 1 or rate_bps <= 0 or worker_ratio <= 0 or coordinator_ratio <= 0:
        raise ValueError(f"shards {list(shard_loads_bytes)}, workers {num_workers}, rate {rate_bps}, "
                         f"ratios {worker_ratio}/{coordinator_ratio}: need a shard, a worker and positive values")
    model_bytes = float(sum(shard_loads_bytes))
    byte_s = 8.0 / rate_bps
    worker_loads = list(shard_loads_bytes[1:]) + [0.0] * max(0, num_workers - (len(shard_loads_bytes) - 1))
    worker_s = max((model_bytes - s + (num_workers - 1) * s) / worker_ratio * byte_s for s in worker_loads)
    s0 = shard_loads_bytes[0]
    pushes_in_s = (s0 if coordinator_pushed_first else model_bytes - min(worker_loads)) / worker_ratio * byte_s
    coordinator_s = pushes_in_s + num_workers * s0 / coordinator_ratio * byte_s
    return max(worker_s, coordinator_s)


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def point_model(point: dict[str, Any]) -> ModelRow | None:
    """The model row of one point of a report (a report.json's ``points`` item), or None when it has no
    rate-limited link, no measured step or an engine the model does not cover."""
    profiles = ((point.get("cluster") or {}).get("link") or {}).get("profiles") or {}
    rates = [p.get("rate_bps") for p in profiles.values() if isinstance(p, dict)]
    if not rates or any(not r for r in rates):
        return None
    rate = min(rates) * TCP_PAYLOAD_SHARE
    ok = [r for r in point.get("repeats") or [] if r.get("status") == "ok" and r.get("nodes")]
    measured = _median([r["totals"]["step_time_median_s"] for r in ok
                        if (r.get("totals") or {}).get("step_time_median_s")])
    config = point.get("config") or {}
    workers = int(config.get("num_workers") or 0)
    if not measured or not ok or workers < 1:
        return None
    steps = [node["compute_time_s"] / node["steps"] for rep in ok for name, node in rep["nodes"].items()
             if name.startswith("worker") and node.get("steps") and node.get("compute_time_s")]
    compute_s = _median(steps) or 0.0
    first = ok[0]
    coord = first["nodes"].get("coordinator", {})
    engine = config.get("engine", "wiiide")
    if engine == "ddp":
        grad_bytes = next((n.get("gradient_bytes") for n in first["nodes"].values() if n.get("gradient_bytes")), None)
        if not grad_bytes or config.get("ddp_comm_hook", "none") != "none":
            return None
        return ModelRow(dict(point.get("params") or {}), 2 * (workers - 1) / workers * grad_bytes * 8 / rate, measured)
    ps = coord.get("ps") or {}
    loads = ps.get("shard_loads_bytes")
    if engine != "wiiide" or not loads or config.get("staleness_bound", 0) not in (0, "0"):
        return None
    worker_ratios = [n.get("compression_ratio") or 1.0 for k, n in first["nodes"].items() if k.startswith("worker")]
    link_s = sharded_link_s(loads, workers, rate, ps.get("partition_balance") == "pipeline",
                            _median(worker_ratios) or 1.0, coord.get("compression_ratio") or 1.0)
    return ModelRow(dict(point.get("params") or {}), compute_s + link_s, measured)


def model_rows(report: dict[str, Any]) -> list[ModelRow]:
    """`point_model` of every point of a report (report.json as parsed) that the model covers."""
    return [row for row in (point_model(p) for p in report.get("points") or []) if row is not None]


def render(rows: Sequence[ModelRow]) -> str:
    """Rows as text: the point's parameters, model ms, measured ms, error %."""
    lines = [f"{'point':60} {'model ms':>9} {'measured ms':>12} {'error':>7}"]
    for row in rows:
        label = ", ".join(f"{k}={v}" for k, v in row.params.items())
        lines.append(f"{label[:60]:60} {row.model_step_s * 1e3:9.1f} {row.measured_step_s * 1e3:12.1f} "
                     f"{row.error * 100:+6.1f}%")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m harness.present.round_model REPORT``; exit status 0, or 2 with the error."""
    parser = argparse.ArgumentParser(prog="python -m harness.present.round_model", description=__doc__.split("\n")[0])
    parser.add_argument("report", help="a sweep's report.json")
    args = parser.parse_args(argv)
    try:
        report = json.loads(Path(args.report).read_text())
    except (OSError, ValueError) as exc:
        print(f"error: {args.report}: {exc}", file=sys.stderr)
        return 2
    if not isinstance(report, dict) or not isinstance(report.get("points"), list):
        print(f"error: {args.report}: not a sweep report (no 'points')", file=sys.stderr)
        return 2
    rows = model_rows(report)
    print(render(rows) if rows else "no point on a rate-limited link that the model covers")
    return 0


if __name__ == "__main__":
    sys.exit(main())
