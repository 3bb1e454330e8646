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
(`harness.engines`), the guide's Training Summary (throughput_samples_per_s, step_time_avg/min/max_s
after warm-up, rss_avg_bytes) and the communication profile (comm_expected/measured_bytes_per_step,
comm_share).
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from harness.errors import HarnessError
from harness.link import LINK_COLUMNS, link_cells
from harness.engines import engine_totals
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


def run_totals(nodes: dict[str, dict[str, Any]], containers: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The per-repeat figures people compare, computed from the nodes' own metrics and container stats."""
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
        "worker_batches_sum": sum(n.get("batches") or 0 for n in workers),
        "container_net_rx_bytes": sum(v or 0 for v in rx) if has_net else None,
        "container_net_tx_bytes": sum(v or 0 for v in tx) if has_net else None,
        "container_net_bytes": sum(v or 0 for v in rx + tx) if has_net else None,
        **engine_totals(nodes, containers),  # the guide's Training Summary and the communication profile
    }


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


def _fmt(value: Any, kind: str = "") -> str:
    if value is None:
        return "-"
    if kind == "bytes_per_s":
        return f"{value / 1e6:.2f}"
    if kind == "pct":
        return f"{100 * value:.1f}"
    if kind == "ms":
        return f"{1000 * value:.2f}"
    if kind == "mb":
        return f"{value / 1e6:.0f}"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


# (column title, summary key, format)
TABLE_COLUMNS = [
    ("batches/s", "batches_per_s", ""),
    ("goodput MB/s", "goodput_bytes_per_s", "bytes_per_s"),
    ("step ms", "step_time_median_s", "ms"),
    ("net s/worker", "worker_network_time_s", ""),
    ("ratio", "compression_ratio", ""),
    ("acc %", "test_accuracy", "pct"),
    ("RSS MB", "peak_rss_bytes", "mb"),
]


def format_table(report: dict[str, Any]) -> str:
    """The points as a fixed-width table: params, status, repeats, then medians over repeats (± stdev)."""
    params = report.get("param_names") or sorted({k for p in report["points"] for k in p.get("params", {})})
    has_links = any((p.get("cluster") or {}).get("link") for p in report["points"])  # shaped: show what was applied
    header = ["#", *params, *(LINK_COLUMNS if has_links else []), "status", "n", *[c[0] for c in TABLE_COLUMNS]]
    rows = []
    for point in report["points"]:
        summary = point.get("summary", {})
        cells = [str(point["index"]), *[_fmt(point["params"].get(p)) for p in params],
                 *(link_cells(point) if has_links else []), point["status"],
                 str(sum(r["status"] == "ok" for r in point.get("repeats", [])))]
        for _, key, kind in TABLE_COLUMNS:
            stats = summary.get(key)
            text = _fmt(stats["median"], kind) if stats else "-"
            if stats and stats["count"] > 1 and stats["stdev"]:
                text += "±" + _fmt(stats["stdev"], kind)
            if key in point.get("unstable", []):
                text += "!"
            cells.append(text)
        rows.append(cells)
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(header, widths)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    backend = report.get("backend", {})
    machine = report.get("machine_info", {})
    title = (f"{report.get('name')} ({report.get('spec', {}).get('description', '')}) | backend {backend.get('name')} | "
             f"{machine.get('cpu_count_logical')} CPUs, {(machine.get('memory_total_bytes') or 0) / 2**30:.0f} GiB | "
             f"commit {(report.get('commit_info', {}).get('id') or '?')[:10]}"
             f"{'' if report.get('complete') else ' | INCOMPLETE'}")
    notes = []
    for point in report["points"]:
        if point["status"] != "ok" and point.get("error"):
            notes.append(f"point {point['index']} {point['status']}: {point['error']}")
    legend = "medians over repeats, ±stdev; '!' marks a spread over 10 % of the mean (unstable)"
    return "\n".join([title, *lines, legend, *notes])
