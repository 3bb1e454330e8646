"""What every backend shares: the `Backend` protocol, the result of one run (`RunResult`), phase
timings (`PhaseClock`), reading node metrics and judging a run. The loop that drives a backend
through one run is `harness.run.loop.run_point`."""

from __future__ import annotations

import json
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Protocol, Sequence, runtime_checkable

from harness.errors import ClusterError
from harness.run.faults import Controller
from harness.spec.cluster import ClusterSettings
from harness.spec.faults import Fault
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
    # seconds per phase of the harness's own work and of the run (PhaseClock): where a point's time went
    phases_s: dict[str, float] = field(default_factory=dict)
    # the machine's scheduler over the coordinator's timed steps (harness.analysis.sched_trace.CoreLoss.to_dict,
    # or {"error": ...}); None when not traced (``sweep --sched-trace``)
    sched: dict[str, Any] | None = None


class PhaseClock:
    """Wall-clock seconds per phase of one run (``clean``, ``create``, ``shape``, ``gate``, ``run``,
    ``stop``, ``collect``, ``teardown``, ...), measured with `time.monotonic`.

    A phase timed twice adds up. `phases_s` keeps the order the phases first ran in; it is what
    `RunResult.phases_s` and the report record, so a user sees where a point's time went.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.t0 = clock()
        self.phases_s: dict[str, float] = {}

    def elapsed_s(self) -> float:
        """Seconds since this clock was made (the start of the run)."""
        return self._clock() - self.t0

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the ``with`` body as phase `name` (seconds, added to any earlier time of that name),
        also when the body raises."""
        t = self._clock()
        try:
            yield
        finally:
            self.phases_s[name] = round(self.phases_s.get(name, 0.0) + self._clock() - t, 3)


@dataclass
class Collected:
    """What a backend reads back after its nodes have stopped (`Backend.collect`).

    `exit_codes`: node (container or process) name -> exit code, None when it never exited.
    `containers`: name -> ``{role, kind, exit_code, samples, summary}`` (harness.run.stats figures).
    `links` / `limits`: link shaping and CPU/memory limits in force (harness.run.shaping), {} if none.
    """

    exit_codes: dict[str, int | None] = field(default_factory=dict)
    containers: dict[str, dict[str, Any]] = field(default_factory=dict)
    links: dict[str, Any] = field(default_factory=dict)
    limits: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Backend(Protocol):
    """A way to run one cluster (a coordinator and `num_workers` workers) for one run.

    A backend supplies only the parts that differ between places a cluster can run: `start`,
    `poll`, `stop`, `collect` and `teardown`. The loop around them (timeout, progress lines,
    fault injection, judging the outcome, phase timings) is written once, in
    `harness.run.loop.run_point`. Backends today: `harness.run.compose.ComposeBackend` (``docker``,
    Docker Compose) and `harness.run.local.LocalBackend` (``local``, processes on 127.0.0.1); a
    Swarm backend goes in ``harness/run/swarm.py`` and is named in `harness.run.select`.
    """

    name: str
    poll_interval_s: float  # seconds between two `poll` calls while a run goes on

    def describe(self) -> dict[str, Any]:
        """What the report records about the backend (name, versions)."""
        ...

    def check_cluster(self, cluster: ClusterSettings | None) -> None:
        """Raise ClusterError when this backend cannot apply a point's links, CPU or memory limits
        (they are never silently ignored); None or empty settings always pass. Needs no engine: a
        classmethod on every backend, so that ``sweep --dry-run`` calls it on the class."""
        ...

    def check_faults(self, faults: Sequence[Fault]) -> None:
        """Raise ClusterError when this backend cannot inject one of `faults`. A classmethod, as `check_cluster`."""
        ...

    def start(self, cfg: RunConfig, out_dir: Path, cluster: ClusterSettings, progress: Progress,
              clock: PhaseClock) -> Controller:
        """Start the nodes with `cfg`, node metrics going to ``out_dir/nodes``; shape links, set
        limits and open the start gate; time each step on `clock`. Return the fault `Controller`.

        Raises:
            ClusterError: the nodes cannot be started.
            LinkShapingError: a link profile cannot be applied.
        """
        ...

    def poll(self) -> dict[str, str]:
        """Each node's state now: name -> ``running`` (or ``created``/``paused``...) or ``exited``."""
        ...

    def stop(self) -> None:
        """Stop sampling and every node still running (after the run or a timeout). Idempotent."""
        ...

    def collect(self, logs_dir: Path, progress: Progress) -> Collected:
        """Exit codes, per-node stats, links and limits; write each node's log to `logs_dir`."""
        ...

    def teardown(self) -> None:
        """Remove whatever this backend started. Idempotent; safe after a failure."""
        ...


def refuse_cluster_settings(backend_name: str, cluster: ClusterSettings | None) -> None:
    """`Backend.check_cluster` of a backend that applies no links or limits.

    Raises:
        ClusterError: `cluster` asks for something (naming what, and the backend that can).
    """
    refuse_overlay_encrypted(backend_name, cluster)
    if cluster is not None and not cluster.is_empty:
        raise ClusterError(f"the {backend_name} backend cannot shape links or limit CPUs and memory (asked: "
                           f"{', '.join(k for k, v in cluster.to_dict().items() if v)}); use --backend docker")


def refuse_overlay_encrypted(backend_name: str, cluster: ClusterSettings | None) -> None:
    """`Backend.check_cluster`'s part for a backend without an overlay network (docker, local).

    Raises:
        ClusterError: `cluster` asks for ``overlay_encrypted`` (only the swarm backend's overlay has it).
    """
    if cluster is not None and cluster.overlay_encrypted:
        raise ClusterError(f"overlay_encrypted: true needs the swarm backend's overlay network; the {backend_name} "
                           "backend has none (use --backend swarm, or tls: true for encryption on this backend)")


def default_timeout_s(cfg: RunConfig) -> float:
    """Seconds a run may take before it counts as hung: connect timeout + duration + `RUN_MARGIN_S`."""
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


# How often an engine backend lists its containers while a run goes on: one list call costs dockerd and
# the harness about 6 ms of CPU (mean of 100 on a two-core host, five containers); four a second took
# 1.2 % of that host from the run being measured.
ENGINE_POLL_INTERVAL_S = 1.0


class Sampler:
    """Calls `sample()` every `interval_s` on a daemon thread until `stop()`; keeps the records."""

    def __init__(self, sample: Callable[[float], None], interval_s: float) -> None:
        self._sample = sample
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def start(self) -> "Sampler":
        """Start sampling on the daemon thread; returns self."""
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._sample(time.monotonic() - self._t0)
            self._stop.wait(self._interval_s)

    def stop(self) -> None:
        """Stop sampling; waits up to 10 s for a sample under way."""
        self._stop.set()
        self._thread.join(timeout=10)
