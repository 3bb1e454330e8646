"""Small, realistic sweep reports for tests that render them, so they need neither Docker nor a sweep.
Numbers are shaped like a real docker run of seed-buffers. They are JSON objects of schema version 1
(the untyped reports written before harness/results/models.py), so every test that renders them also
checks that version-1 reports still load and render."""

from __future__ import annotations

import copy
import itertools
import json
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import yaml

from harness.results.models import Repeat
from harness.results.totals import point_summary

REPO_ROOT = Path(__file__).resolve().parent.parent

FAILED_ERROR = ("repeat 0: timed out after 90 s; nodes still running were stopped; "
                "worker-2 exited 137 <OOM & killed>")
PARTIAL_ERROR = "repeat 1: coordinator: ProtocolError: frame of 2147483648 bytes > max_frame_bytes"


def summary_v1(repeats: list[dict[str, Any]]) -> tuple[dict[str, Any], list[str]]:
    """A point's `summary` and `unstable` as version 1 wrote them, from its repeats' raw values."""
    summary, unstable = point_summary([Repeat.model_validate(r) for r in repeats])
    return {key: stats.model_dump() for key, stats in summary.items()}, unstable


def load_spec(path: Path, first_of: tuple[str, ...] = ()) -> SimpleNamespace:
    """The parts of a shipped spec a report holds, read with yaml alone (the tests of the page need not
    follow every change of harness/spec.py): to_dict(), param_names, points with params and config.
    The axes named in `first_of` keep their first value only (into the base), as ``--only`` would."""
    data = yaml.safe_load(path.read_text())
    axes = dict(data.get("axes") or {})
    base = dict(data.get("base") or {})
    for name in first_of:
        if name in axes:
            base[name] = axes.pop(name)[0]
    data["base"] = base
    spec_dict = {"name": data["name"], "description": data.get("description", ""), "repeats": data.get("repeats", 1),
                 "base": data.get("base") or {}, "axes": axes, "reference": data.get("reference") or {},
                 "timeout_s": data.get("timeout_s"), "source": f"experiments/{path.name}"}
    points = []
    for index, combo in enumerate(itertools.product(*axes.values())):
        params = dict(zip(axes, combo))
        config = {**spec_dict["base"], **params}
        if "buffer_bytes" in config:
            config["sndbuf_bytes"] = config["rcvbuf_bytes"] = config.pop("buffer_bytes")
        points.append(SimpleNamespace(index=index, params=params, config=SimpleNamespace(
            num_workers=config.get("num_workers", 2), to_dict=lambda c=config: dict(c))))
    return SimpleNamespace(name=spec_dict["name"], param_names=list(axes), points=points,
                           to_dict=lambda: copy.deepcopy(spec_dict))


def _samples(role: str, rate_mb_s: float, t_start: float, n: int, docker: bool) -> list[dict[str, Any]]:
    out, rx, tx = [], 0, 0
    for i in range(n):
        t = t_start + i * 1.01
        busy = 0 < i < n - 1
        rx += int((rate_mb_s * 0.45e6 if busy else 0) * 1.01)
        tx += int((rate_mb_s * 0.55e6 if busy else 0) * 1.01)
        out.append({
            "t_s": round(t, 3),
            "cpu_percent": round((55.0 if role == "coordinator" else 42.0) + 8 * math.sin(i) if busy else 1.0, 3),
            "memory_bytes": (290 if role == "coordinator" else 150) * 10**6 + i * 10**5,
            "net_rx_bytes": rx if docker else None,
            "net_tx_bytes": tx if docker else None,
            "blk_read_bytes": 0,
            "blk_write_bytes": 0,
        })
    return out


def _repeat(repeat: int, batches_per_s: float, workers: int, status: str = "ok", error: str | None = None,
            docker: bool = True) -> dict[str, Any]:
    train_s = 30.0
    goodput = batches_per_s * 1.2e6 / 2  # bytes/s through the coordinator
    names = (["wiiide_coordinator_1"] + [f"wiiide_worker_{i + 1}" for i in range(workers)] if docker
             else ["coordinator"] + [f"worker-{i + 1}" for i in range(workers)])
    containers = {}
    for name in names:
        role = "coordinator" if "coordinator" in name else "worker"
        rate = goodput / 1e6 / (1 if role == "coordinator" else workers)
        samples = _samples(role, rate, 8.0 + (0.5 if role == "worker" else 0), 12, docker)
        last = samples[-1]
        containers[name] = {"role": role, "kind": "container" if docker else "process", "exit_code": 0,
                            "samples": samples,
                            "summary": {"sample_count": len(samples), "net_rx_bytes": last["net_rx_bytes"],
                                        "net_tx_bytes": last["net_tx_bytes"]}}
    if status != "ok":
        return {"repeat": repeat, "status": status, "error": error, "started_at_utc": "2026-11-21T15:10:00+00:00",
                "elapsed_s": 90.2, "totals": {}, "nodes": {}, "containers": containers, "exit_codes": {}}
    net = sum((c["summary"]["net_rx_bytes"] or 0) + (c["summary"]["net_tx_bytes"] or 0) for c in containers.values())
    totals = {
        "steps": int(batches_per_s * train_s / workers), "batches": int(batches_per_s * train_s),
        "train_time_s": train_s, "batches_per_s": batches_per_s, "samples_per_s": batches_per_s * 32,
        "goodput_bytes_per_s": goodput, "wire_bytes_per_s": goodput * 1.01, "test_accuracy": 0.95 + 0.001 * repeat,
        "loss_final": 0.05, "loss_avg": 0.2, "step_time_median_s": workers / batches_per_s,
        "worker_network_time_s": 12.0 + repeat, "compression_ratio": 1.0, "compression_time_s": 0.01,
        "peak_rss_bytes": 420_000_000, "batches_per_worker": {str(i + 1): int(batches_per_s * train_s / workers)
                                                             for i in range(workers)},
        "worker_batches_sum": int(batches_per_s * train_s),
        "container_net_rx_bytes": net // 2 if docker else None, "container_net_tx_bytes": net // 2 if docker else None,
        "container_net_bytes": net if docker else None,
    }
    sockets = [{"rank": i + 1, "sndbuf_requested_bytes": 2**20, "rcvbuf_requested_bytes": 2**20,
                "sndbuf_bytes": 2**21, "rcvbuf_bytes": 2**21, "tcp_nodelay": True, "tcp_quickack": True,
                "keepalive": True} for i in range(workers)]
    return {"repeat": repeat, "status": "ok", "error": None, "started_at_utc": "2026-11-21T15:10:00+00:00",
            "elapsed_s": 41.5, "totals": totals,
            "nodes": {"coordinator": {"role": "coordinator", "status": "ok", "socket_options": sockets}},
            "containers": containers, "exit_codes": {n: 0 for n in names}, "logs_dir": f"point/repeat-{repeat}/logs"}


def buffers_report(docker: bool = True, complete: bool = True) -> dict[str, Any]:
    """seed-buffers shaped: 1MiB and 4MiB ok (3 repeats), 8MiB partial, 16MiB failed; its real spec, on its
    first link (unshaped) only."""
    spec = load_spec(REPO_ROOT / "experiments" / "seed-buffers.yaml", first_of=("link",))
    workers = spec.points[0].config.num_workers
    plans = {
        "1MiB": [("ok", 300.0), ("ok", 320.0), ("ok", 290.0)],
        "4MiB": [("ok", 410.0), ("ok", 380.0), ("ok", 430.0)],
        "8MiB": [("ok", 450.0), ("failed", PARTIAL_ERROR), ("ok", 470.0)],
        "16MiB": [("failed", FAILED_ERROR)],
    }
    points = []
    for p in spec.points:
        value = p.params["buffer_bytes"]
        repeats = [_repeat(i, x, workers, docker=docker) if s == "ok"
                   else _repeat(i, 0, workers, "failed", x, docker=docker) for i, (s, x) in enumerate(plans[value])]
        summary, unstable = summary_v1(repeats)
        ok = [r for r in repeats if r["status"] == "ok"]
        status = "ok" if len(ok) == len(repeats) else ("partial" if ok else "failed")
        error = None if status == "ok" else "; ".join(r["error"] for r in repeats if r["status"] != "ok")
        points.append({"index": p.index, "params": dict(p.params), "config": p.config.to_dict(), "status": status,
                       "error": error, "repeats": repeats, "summary": summary, "unstable": unstable})
    backend = ({"name": "docker", "engine_version": "20.10.24+dfsg1", "compose": "docker-compose",
                "compose_version": "docker-compose version 1.29.2", "image": "wiiide:latest"} if docker
               else {"name": "local"})
    report = {
        "schema_version": 1, "name": spec.name, "created_at_utc": "2026-11-21T15:08:27+00:00",
        "updated_at_utc": "2026-11-21T15:20:02+00:00", "complete": complete,
        "machine_info": {"cpu_count_logical": 2, "cpu_model": "AMD EPYC", "memory_total_bytes": 25276502016,
                         "kernel": "6.18.44", "rmem_max_bytes": 4194304, "wmem_max_bytes": 4194304},
        "commit_info": {"id": "9bad02fcbd3e70cf204e252b63748447752c996a", "branch": "main", "dirty": False},
        "backend": backend, "spec": spec.to_dict(), "param_names": spec.param_names, "points": points,
    }
    if not complete:
        report["note"] = "interrupted by SIGINT after 10 of 12 runs"
    return report


def compression_report() -> dict[str, Any]:
    """seed-compression shaped (another axis, dict-valued reference), every point ok, 1 repeat."""
    spec = load_spec(REPO_ROOT / "experiments" / "seed-compression.yaml")
    report = buffers_report()
    report["name"], report["spec"], report["param_names"] = spec.name, spec.to_dict(), spec.param_names
    template = report["points"][0]
    points = []
    for p, speed in zip(spec.points, (450.0, 300.0, 120.0, 500.0)):
        point = copy.deepcopy(template)
        repeats = [_repeat(0, speed, p.config.num_workers)]
        repeats[0]["totals"]["compression_ratio"] = 1.0 if p.params["compression"] == "none" else 1.9
        summary, unstable = summary_v1(repeats)
        point.update(index=p.index, params=dict(p.params), config=p.config.to_dict(), status="ok", error=None,
                     repeats=repeats, summary=summary, unstable=unstable)
        points.append(point)
    report["points"] = points
    return report


def report_validator():
    """A jsonschema validator of the shipped report schema (harness/results/report.schema.json) that
    resolves its ``$ref`` to the shipped node metrics schema offline (no fetch of the ``$id`` URL)."""
    import jsonschema
    from referencing import Registry, Resource

    from harness.results.schema import NODE_METRICS_SCHEMA_PATH, SCHEMA_PATH

    node = json.loads(NODE_METRICS_SCHEMA_PATH.read_text())
    registry = Registry().with_resource(node["$id"], Resource.from_contents(node))
    return jsonschema.Draft202012Validator(json.loads(SCHEMA_PATH.read_text()), registry=registry)
