"""Sweep reports: one JSON file per sweep, written after every run, and a table people can read.

Layout of ``results/<name>-<UTC timestamp>/report.json`` (after pyperf / pytest-benchmark: metadata
first, raw values kept, statistics computed from them)::

    schema_version, name, created_at_utc, updated_at_utc, complete,
    machine_info, commit_info, backend, spec, param_names,
    points: [{index, params, config, status, error,
              repeats: [{repeat, status, error, started_at_utc, elapsed_s, totals,
                         nodes: {coordinator: {...}, worker-1: {...}},     # each node's own metrics
                         containers: {<name>: {role, exit_code, samples, summary}},
                         links: {capabilities, containers: {<name>: {requested, applied, unsupported,
                                 end_counters, ...}}}, limits: {<name>: {cpus, mem_limit_bytes}},
                         logs_dir}],                           # links/limits: harness/cluster/shaping.py
              summary: {<total>: {count, mean, stdev, median, min, max, p95}}, unstable: [...]}]

`totals` of a repeat (units in the names): batches, batches_per_s, samples_per_s, steps, train_time_s,
goodput_bytes_per_s (tensor bytes through the coordinator per second of training, both directions),
wire_bytes_per_s (whole frames), test_accuracy, loss_final, step_time_median_s,
worker_network_time_s (mean over workers), compression_ratio, peak_rss_bytes (largest node), and the
containers' net_rx_bytes / net_tx_bytes summed (docker backend); then, for every engine
(`harness.results.totals`), the guide's Training Summary (throughput_samples_per_s, step_time_avg/min/max_s
after warm-up, rss_avg_bytes) and the communication profile (comm_expected/measured_bytes_per_step,
comm_share).
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from harness.errors import HarnessError
from harness.present.links_text import LINK_COLUMNS, link_cells
from harness.results.totals import engine_totals
from wiiide.metrics import summarize, write_json_atomic


SCHEMA_VERSION = 1


# A summary whose stdev is above this fraction of its mean is flagged "unstable" (as pyperf does).
UNSTABLE_CV = 0.10


SUMMARY_KEYS = ("batches_per_s", "samples_per_s", "goodput_bytes_per_s", "wire_bytes_per_s", "test_accuracy",
                "loss_final", "step_time_median_s", "worker_network_time_s", "compression_ratio", "peak_rss_bytes",
                "container_net_bytes", "throughput_samples_per_s", "step_time_avg_s", "comm_share",
                "comm_measured_bytes_per_step", "rss_avg_bytes", "coordinator_egress_utilisation")


def utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def point_summary(repeats: list[dict[str, Any]]) -> tuple[dict[str, Any], list[str]]:
    """Statistics over the ok repeats of a point, and the keys whose spread makes them unstable."""
    ok = [r for r in repeats if r.get("status") == "ok"]
    summary, unstable = {}, []
    for key in SUMMARY_KEYS:
        values = [r["totals"][key] for r in ok if r.get("totals", {}).get(key) is not None]
        if not values:
            continue
        stats = summarize(values)
        summary[key] = stats
        if stats["count"] > 1 and stats["mean"] and stats["stdev"] / abs(stats["mean"]) > UNSTABLE_CV:
            unstable.append(key)
    return summary, unstable


class ReportWriter:
    """Holds a sweep's report and rewrites it atomically after every repeat, so nothing done is lost."""

    def __init__(self, path: Path, header: dict[str, Any]) -> None:
        self.path = path
        self.data: dict[str, Any] = {"schema_version": SCHEMA_VERSION, **header, "created_at_utc": utc_now(),
                                     "complete": False, "points": []}

    @classmethod
    def resume(cls, path: Path) -> "ReportWriter":
        """Continue an existing report (``sweep --resume``). Raises HarnessError if it cannot be read."""
        writer = cls.__new__(cls)
        writer.path = path
        writer.data = load_report(path)
        writer.data["resumed_at_utc"] = [*writer.data.get("resumed_at_utc", []), utc_now()]
        return writer

    def finished_point(self, index: int, params: dict[str, Any]) -> dict[str, Any] | None:
        """The point with this index and params if it finished ok (a resumed sweep skips it)."""
        for point in self.data["points"]:
            if point["index"] == index and point["params"] == params and point["status"] == "ok":
                return point
        return None

    def start_point(self, index: int, params: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
        """A new entry for a point, replacing an unfinished one of the same index (kept in index order)."""
        point = {"index": index, "params": params, "config": config, "status": "running", "error": None,
                 "repeats": [], "summary": {}, "unstable": []}
        self.data["points"] = sorted([p for p in self.data["points"] if p["index"] != index] + [point],
                                     key=lambda p: p["index"])
        return point

    def add_repeat(self, point: dict[str, Any], repeat: dict[str, Any]) -> None:
        point["repeats"].append(repeat)
        point["summary"], point["unstable"] = point_summary(point["repeats"])
        self.save()

    def finish_point(self, point: dict[str, Any]) -> None:
        statuses = [r["status"] for r in point["repeats"]]
        if statuses and all(s == "ok" for s in statuses):
            point["status"], point["error"] = "ok", None
        elif any(s == "ok" for s in statuses):
            point["status"] = "partial"
            point["error"] = "; ".join(f"repeat {r['repeat']}: {r['error']}" for r in point["repeats"] if r["status"] != "ok")
        else:
            point["status"] = "failed"
            point["error"] = "; ".join(f"repeat {r['repeat']}: {r['error']}" for r in point["repeats"]) or "not run"
        self.save()

    def finish(self, complete: bool, note: str | None = None) -> None:
        self.data["complete"] = complete
        if note:
            self.data["note"] = note
        self.save()

    def save(self) -> None:
        self.data["updated_at_utc"] = utc_now()
        write_json_atomic(self.path, self.data)


def load_report(path: str | Path) -> dict[str, Any]:
    """Read a report (a report.json or the folder holding it). Raises HarnessError if it cannot."""
    path = Path(path)
    if path.is_dir():
        path = path / "report.json"
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise HarnessError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise HarnessError(f"{path}: not valid JSON: {exc}") from None
    if not isinstance(data, dict) or "points" not in data:
        raise HarnessError(f"{path}: not a WIIIIIDE sweep report (no 'points')")
    return data


def newest_report(results_dir: Path) -> Path:
    """The most recently written report.json under `results_dir`. Raises HarnessError if none."""
    reports = sorted(results_dir.glob("*/report.json"), key=lambda p: p.stat().st_mtime)
    if not reports:
        raise HarnessError(f"no report.json under {results_dir}; run a sweep first (make demo)")
    return reports[-1]
