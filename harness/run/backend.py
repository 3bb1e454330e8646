"""What every backend shares: the result of one run, node-metrics collection, backend selection."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from harness.errors import ClusterError
from wiiide.config import RunConfig
from wiiide.metrics import SCHEMA_VERSION as NODE_SCHEMA_VERSION

Progress = Callable[[str], None]


# Seconds allowed beyond the run's duration and connect timeout before a run counts as hung.
RUN_MARGIN_S = 60.0


@dataclass
class RunResult:
    """One run of a cluster: status, each node's own metrics, each container's (or process's) stats."""

    status: str  # "ok" | "failed"
    error: str | None
    elapsed_s: float
    nodes: dict[str, dict[str, Any]] = field(default_factory=dict)
    containers: dict[str, dict[str, Any]] = field(default_factory=dict)
    exit_codes: dict[str, int | None] = field(default_factory=dict)
    logs_dir: str | None = None
    # link shaping per container: requested, applied (tc read-back), unsupported, end counters; and the
    # CPU/memory limits in force (harness/cluster/shaping.py); empty when the point asks for none
    links: dict[str, Any] = field(default_factory=dict)
    limits: dict[str, Any] = field(default_factory=dict)
    faults: list[dict[str, Any]] = field(default_factory=list)  # injected faults and when (harness.spec.faults, harness.run.faults)


class Backend:
    """Interface of a cluster backend."""

    name = "abstract"

    def describe(self) -> dict[str, Any]:
        """What the report records about the backend (name, versions)."""
        return {"name": self.name}

    def check_cluster(self, cluster) -> None:
        """Raise ClusterError when this backend cannot apply a point's `ClusterSettings` (links, CPU and
        memory limits): they are never silently ignored. Only the docker backend applies them."""
        if cluster is not None and not cluster.is_empty:
            raise ClusterError(f"the {self.name} backend cannot shape links or limit CPUs and memory (asked: "
                               f"{', '.join(k for k, v in cluster.to_dict().items() if v)}); use --backend docker")

    def run(self, cfg: RunConfig, out_dir: Path, timeout_s: float | None, progress: Progress,
            cluster=None) -> RunResult:
        """Run one cluster with `cfg` to its end; write logs and node metrics under `out_dir`.
        `cluster`: the point's `harness.spec.cluster.ClusterSettings` (None: nothing asked)."""
        raise NotImplementedError

    def check_faults(self, faults) -> None:
        """Raise ClusterError when this backend cannot inject one of `faults` (harness.spec.faults, harness.run.faults)."""

    def teardown(self) -> None:
        """Stop and remove whatever this backend started. Idempotent; safe after a failure."""


def default_timeout_s(cfg: RunConfig) -> float:
    return cfg.connect_timeout_s + cfg.duration_s + RUN_MARGIN_S


def collect_nodes(nodes_dir: Path) -> dict[str, dict[str, Any]]:
    """Read every node's metrics file in `nodes_dir` (``coordinator.json``, ``worker-<rank>.json``)."""
    nodes: dict[str, dict[str, Any]] = {}
    for path in sorted(nodes_dir.glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            nodes[path.stem] = {"status": "unreadable", "error": f"{path.name}: {exc}"}
            continue
        if data.get("schema_version") != NODE_SCHEMA_VERSION:
            data["schema_warning"] = f"node schema {data.get('schema_version')} != {NODE_SCHEMA_VERSION}"
        nodes[path.stem] = data
    return nodes


def judge(nodes: dict[str, dict[str, Any]], exit_codes: dict[str, int | None], num_workers: int,
          expected_dead: set[str] | frozenset[str] = frozenset(),
          expected_node_ids: set[str] | frozenset[str] = frozenset()) -> tuple[str, str | None]:
    """A run is ok when every node exited 0 and the coordinator and all workers wrote ok metrics.

    `expected_dead`: workers (``worker-N``) a fault injection hit, and `expected_node_ids` the node ids
    of their metrics: their exit, failed or missing metrics are the fault's effect, not a failure;
    whether the cluster kept training is the coordinator's to say.
    """
    expected_dead = {n for n in expected_dead if n.startswith("worker-")}  # a lost coordinator fails the run
    problems = []
    for name, code in sorted(exit_codes.items()):
        if code != 0 and _node_name(name) not in expected_dead:
            problems.append(f"{name} exited {code}")
    coordinator = nodes.get("coordinator")
    if coordinator is None:
        problems.append("the coordinator wrote no metrics")
    elif coordinator.get("status") != "ok":
        problems.append(f"coordinator: {coordinator.get('error') or coordinator.get('status')}")
    workers = [n for name, n in nodes.items() if name.startswith("worker")]
    for node in workers:
        if node.get("status") != "ok" and node.get("node_id") not in expected_node_ids:
            problems.append(f"worker {node.get('rank') or node.get('node_id')}: {node.get('error') or node.get('status')}")
    if len(workers) < num_workers - len(expected_dead):
        problems.append(f"{len(workers)} of {num_workers} workers wrote metrics")
    return ("ok", None) if not problems else ("failed", "; ".join(problems))


def _node_name(name: str) -> str:
    """``wiiide_worker_2`` / ``wiiide-worker-2`` / ``worker-2`` -> ``worker-2``; coordinators -> ``coordinator``."""
    parts = name.replace("_", "-").split("-")
    if "coordinator" in parts:
        return "coordinator"
    return f"worker-{parts[-1]}" if "worker" in parts else name


class Sampler:
    """Calls `sample()` every `interval_s` on a daemon thread until `stop()`; keeps the records."""

    def __init__(self, sample: Callable[[float], None], interval_s: float) -> None:
        self._sample = sample
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def start(self) -> "Sampler":
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._sample(time.monotonic() - self._t0)
            self._stop.wait(self._interval_s)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
