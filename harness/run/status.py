"""What a running cluster is doing now: each node's state, training step and rate, each container's
CPU, memory and network, read live from the Docker Engine API.

Sources, for lack of a live metrics endpoint in `wiiide` (its metrics file is written once, when a
node ends):
- the training step and batches/s come from the nodes' progress lines (`wiiide.log.TieredLog.step`,
  tiers ``normal`` and ``verbose``, one line every ``log_every_steps`` steps) in the container logs:
  ``<asctime> coordinator INFO step <n>: loss <x>, <k> workers, <r> batches/s`` and
  ``<asctime> worker[<id>] INFO step <n>: loss <x>``; a node that has ended is read from its metrics
  file (``<results>/nodes/*.json``, the bind mount at ``/results``) instead;
- CPU %, memory without page cache and network rx/tx come from one Engine API stats sample per
  container, with docker's own CLI formulas (`harness.run.stats.parse_sample`).

A node logging at tier ``silent`` shows no step; one logging every 1000 steps shows the last
thousand reached.
"""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Iterable

from harness.run.compose_file import PROJECT_LABEL, SERVICE_LABEL
from harness.run.compose_project import PROJECT
from harness.run.docker_client import docker_client
from harness.run.stats import parse_sample

NUMBER_LABEL = "com.docker.compose.container-number"
RESULTS_MOUNT = "/results"  # where compose.yaml mounts the run's results folder in every node

# A progress line of `wiiide.log.TieredLog` (logging.Formatter "%(asctime)s <name> %(levelname)s %(message)s").
_STEP_LINE = re.compile(r"^(?P<asctime>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) (?P<name>\S+) INFO step (?P<step>\d+):"
                        r"(?P<rest>.*)$")
_BATCHES_PER_S = re.compile(r"(?P<value>[0-9]+(?:\.[0-9]+)?) batches/s")
_CONTRIBUTORS = re.compile(r", (?P<workers>[0-9]+) workers,")
_FINAL_LINE = re.compile(r" INFO held-out (?:accuracy \S+, loss|validation loss \S+, perplexity) \S+ after "
                         r"(?P<step>\d+) steps")
_ASCTIME_FORMAT = "%Y-%m-%d %H:%M:%S,%f"

# How much of a log is read for the last progress lines: the newest lines are enough, and a long
# run's whole log is not read on every refresh.
LOG_TAIL_LINES = 400
LOG_TAIL_BYTES = 256 * 1024
# Rates span the last this many progress lines (fewer when the log has fewer): one interval of
# `log_every_steps` steps is a fraction of a second on a small model, and noisy.
RATE_SPAN_LINES = 5


@dataclass(frozen=True)
class Training:
    """A node's training progress as last reported.

    Attributes:
        step: the last step the node reported (None: none yet, or a silent log tier).
        steps_per_s: steps/s over the node's last `RATE_SPAN_LINES` progress lines (at least two),
            from their timestamps (millisecond resolution); None with fewer than two.
        batches_per_s: batches/s now: `steps_per_s` times the batches of a step (the coordinator's
            ``<k> workers`` of its last line; 1 for a worker); with fewer than two lines, or once the
            node has ended, `mean_batches_per_s`. None: not known.
        mean_batches_per_s: the coordinator's batches/s since training started, as its last line
            (or, once ended, its metrics file) says; None for a worker's log.
        source: ``log`` (progress lines), ``metrics`` (the node's metrics file, written at its end),
            or ``none``.
    """

    step: int | None = None
    batches_per_s: float | None = None
    steps_per_s: float | None = None
    mean_batches_per_s: float | None = None
    source: str = "none"


@dataclass(frozen=True)
class ContainerFigures:
    """One Engine API stats sample of a container, with docker's CLI formulas (`harness.run.stats`).

    Attributes:
        cpu_percent: % of one host core (100 = one core busy) between the sample and the one before.
        memory_bytes: memory usage without page cache, bytes.
        net_rx_bytes, net_tx_bytes: bytes received/sent on all the container's interfaces since it started.
        read_at_s: when the engine read the sample (its ``read`` field), seconds since the epoch;
            None when the sample has no readable time.
    """

    cpu_percent: float
    memory_bytes: int
    net_rx_bytes: int
    net_tx_bytes: int
    read_at_s: float | None = None


def engine_time_s(stamp: str | None) -> float | None:
    """An Engine API time (RFC 3339 with up to nanoseconds, e.g. ``2026-11-23T07:58:33.877490674Z``)
    as seconds since the epoch (microsecond resolution); None for a missing, zero or unreadable one."""
    if not stamp or stamp.startswith("0001-"):
        return None
    match = re.match(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d+))?(Z|[+-]\d\d:\d\d)$", stamp)
    if not match:
        return None
    zone = "+00:00" if match[3] == "Z" else match[3]
    try:
        whole = datetime.fromisoformat(match[1] + zone).timestamp()
    except ValueError:
        return None
    return whole + (int((match[2] or "0")[:6].ljust(6, "0")) / 1e6)


@dataclass(frozen=True)
class NodeStatus:
    """One container of the cluster.

    Attributes:
        container: the container's name (e.g. ``wiiide-worker-1``).
        node: ``coordinator`` or ``worker-<n>`` (n: Compose's container number).
        role: ``coordinator`` or ``worker`` (the Compose service).
        state: the Engine's state (``running``, ``exited``, ``paused``, ...).
        exit_code: the exit code once ``exited`` or ``dead``, else None.
        training: its progress (`Training`).
        figures: its stats sample; None when it is not running.
    """

    container: str
    node: str
    role: str
    state: str
    exit_code: int | None
    training: Training
    figures: ContainerFigures | None


@dataclass(frozen=True)
class ClusterStatus:
    """Every container of one Compose project at one moment.

    Attributes:
        project: the Compose project name.
        taken_at_s: `time.monotonic()` when the snapshot was taken, seconds (for rates between snapshots).
        nodes: the coordinator first, then workers by number; empty when no container of the project exists.
        results_dir: the host folder mounted at /results (node metrics in its ``nodes/``), if any.
    """

    project: str
    taken_at_s: float
    nodes: list[NodeStatus] = field(default_factory=list)
    results_dir: str | None = None

    @property
    def running(self) -> bool:
        """True when at least one container of the project is running."""
        return any(n.state == "running" for n in self.nodes)


def parse_progress_lines(lines: Iterable[str]) -> Training:
    """The last progress of a node from its log lines (`wiiide.log.TieredLog` format).

    Args:
        lines: the node's log lines, oldest first (a tail is enough).

    Returns:
        `Training` from the last ``step <n>:`` lines (the rate over up to `RATE_SPAN_LINES`), or from the coordinator's final ``held-out
        accuracy ... after <n> steps`` line when that comes last (the run has ended: step from it,
        batches/s the last logged mean); ``Training()`` (source ``none``) when there is neither.
        Lines that match neither pattern (other messages, tracebacks) are skipped; no error is raised.
    """
    steps: list[tuple[datetime, int, str]] = []
    final_step = None
    for line in lines:
        match = _STEP_LINE.match(line.rstrip("\r\n"))
        if match:
            try:
                stamp = datetime.strptime(match["asctime"], _ASCTIME_FORMAT)
            except ValueError:
                continue
            steps.append((stamp, int(match["step"]), match["rest"]))
            final_step = None
            continue
        final = _FINAL_LINE.search(line)
        if final:
            final_step = int(final["step"])
    logged = _BATCHES_PER_S.search(steps[-1][2]) if steps else None
    mean_batches_per_s = float(logged["value"]) if logged else None
    if final_step is not None:
        return Training(final_step, mean_batches_per_s, None, mean_batches_per_s, "log")
    if not steps:
        return Training()
    stamp, step, rest = steps[-1]
    steps_per_s = batches_per_s = None
    if len(steps) >= 2:
        stamp0, step0, _ = steps[-min(len(steps), RATE_SPAN_LINES)]
        dt_s = (stamp - stamp0).total_seconds()
        if dt_s > 0 and step > step0:
            steps_per_s = (step - step0) / dt_s
            contributors = _CONTRIBUTORS.search(rest)
            batches_per_s = steps_per_s * (int(contributors["workers"]) if contributors else 1)
    return Training(step, batches_per_s if batches_per_s is not None else mean_batches_per_s, steps_per_s,
                    mean_batches_per_s, "log")


def log_file_training(path: Path) -> Training:
    """`parse_progress_lines` over the last `LOG_TAIL_BYTES` of a node's log file (the local backend
    writes ``<run>/logs/<node>.log``). A missing or unreadable file gives ``Training()`` (no error)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, 2)
            size = fh.seek(max(0, fh.tell() - LOG_TAIL_BYTES))
            data = fh.read()
    except OSError:
        return Training()
    lines = data.decode("utf-8", errors="replace").splitlines()
    return parse_progress_lines(lines[1:] if size else lines)  # the first line of a tail may be cut


def container_log_training(container, tail_lines: int = LOG_TAIL_LINES) -> Training:
    """`parse_progress_lines` over the last `tail_lines` lines of a container's stdout and stderr
    (Engine API logs). A container that is gone or whose logs cannot be read gives ``Training()``."""
    try:
        data = container.logs(stdout=True, stderr=True, tail=tail_lines)
    except Exception:  # docker.errors.APIError / NotFound / requests errors: nothing to read now
        return Training()
    return parse_progress_lines(data.decode("utf-8", errors="replace").splitlines())


def node_name(labels: dict[str, str]) -> str:
    """``coordinator`` or ``worker-<n>`` from a container's Compose labels (service and container number)."""
    service = labels.get(SERVICE_LABEL, "?")
    return "coordinator" if service == "coordinator" else f"{service}-{labels.get(NUMBER_LABEL, '1')}"


def results_dir_of(attrs: dict[str, Any]) -> str | None:
    """The host folder bind-mounted at `RESULTS_MOUNT` in a container (from `docker inspect` attrs), or None."""
    for mount in attrs.get("Mounts") or []:
        if mount.get("Destination") == RESULTS_MOUNT and mount.get("Source"):
            return mount["Source"]
    return None


def metrics_training(nodes_dir: Path, node_id: str) -> Training | None:
    """The final `Training` of the node whose metrics file in `nodes_dir` has this ``node_id``
    (``steps``, ``batches_per_s``), or None when no readable file has it."""
    try:
        paths = sorted(Path(nodes_dir).glob("*.json"))
    except OSError:
        return None
    for path in paths:
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and data.get("node_id") == node_id:
            mean = data.get("batches_per_s") if data.get("role") == "coordinator" else None
            return Training(data.get("steps"), data.get("batches_per_s"), None, mean, "metrics")
    return None


def container_figures(container) -> ContainerFigures | None:
    """One Engine API stats sample of a running container (the engine takes about a second to give
    the two readings CPU % needs), or None when it is not running or gone."""
    try:
        sample = container.stats(stream=False)
    except Exception:  # the container ended meanwhile
        return None
    return figures_from_sample(sample)


def figures_from_sample(sample: dict[str, Any]) -> ContainerFigures | None:
    """`ContainerFigures` of one Engine API stats sample (``GET /containers/{id}/stats?stream=false``),
    with docker's CLI formulas (`harness.run.stats.parse_sample`); None for the empty sample of a
    container that is not running."""
    record = parse_sample(sample, 0.0)
    if record is None:
        return None
    return ContainerFigures(record["cpu_percent"], record["memory_bytes"], record["net_rx_bytes"],
                            record["net_tx_bytes"], engine_time_s(sample.get("read")))


def _exit_code(container) -> int | None:
    if container.status not in ("exited", "dead"):
        return None
    return (container.attrs.get("State") or {}).get("ExitCode")


def _node_status(container, results_dir: str | None) -> NodeStatus:
    labels = container.labels or {}
    running = container.status == "running"
    training = container_log_training(container)
    if not running and results_dir:
        node_id = (container.attrs.get("Config") or {}).get("Hostname") or ""
        if labels.get(SERVICE_LABEL) == "coordinator":
            node_id = "coordinator"  # compose.yaml sets WIIIIIDE_NODE_ID=coordinator
        training = metrics_training(Path(results_dir) / "nodes", node_id) or training
    figures = container_figures(container) if running else None
    return NodeStatus(container.name, node_name(labels), labels.get(SERVICE_LABEL, "?"), container.status,
                      _exit_code(container), training, figures)


def _order(node: NodeStatus) -> tuple[int, int, str]:
    if node.role == "coordinator":
        return (0, 0, node.node)
    number = node.node.rsplit("-", 1)[-1]
    return (1, int(number) if number.isdigit() else 0, node.node)


def read_cluster_status(client=None, project: str = PROJECT) -> ClusterStatus:
    """A snapshot of every container of the Compose `project` (label ``com.docker.compose.project``).

    Reads each container's state, the tail of its logs (step, batches/s), its metrics file once it
    has ended, and one stats sample while it runs; the containers are read in parallel (a stats
    sample takes about a second). Takes 1-3 s.

    Args:
        client: a docker SDK client (default: `harness.run.docker_client.docker_client()`).
        project: the Compose project (default: `harness.run.compose_project.PROJECT`, WIIIIIDE_PROJECT).

    Returns:
        `ClusterStatus`; its ``nodes`` is empty when the project has no container.

    Raises:
        ClusterError: no Docker engine answers (from `docker_client`).
    """
    client = client or docker_client()
    containers = client.containers.list(all=True, filters={"label": f"{PROJECT_LABEL}={project}"})
    taken_at_s = time.monotonic()
    results_dir = next((d for d in (results_dir_of(c.attrs) for c in containers) if d), None)
    if not containers:
        return ClusterStatus(project, taken_at_s, [], None)
    with ThreadPoolExecutor(max_workers=min(8, len(containers))) as pool:
        nodes = list(pool.map(lambda c: _node_status(c, results_dir), containers))
    return ClusterStatus(project, taken_at_s, sorted(nodes, key=_order), results_dir)


def coordinator_training(client=None, project: str = PROJECT) -> Training:
    """The coordinator's `Training` from its container's log tail only (no stats sample: cheap enough
    to poll every second during a sweep). ``Training()`` when the project has no coordinator.

    Raises:
        ClusterError: no Docker engine answers (when `client` is None).
    """
    client = client or docker_client()
    try:
        found = _coordinator_containers(client, "docker", project)
    except Exception:  # the engine hiccuped between two polls: nothing new to show
        return Training()
    return container_log_training(found[0]) if found else Training()


def _coordinator_containers(client, backend_name: str, project: str) -> list:
    """The coordinator's container of `project`: Compose's (``docker``) or the stack's running task's (``swarm``)."""
    if backend_name == "docker":
        return client.containers.list(all=True, filters={
            "label": [f"{PROJECT_LABEL}={project}", f"{SERVICE_LABEL}=coordinator"]})
    from harness.run.swarm.stack import stack_name
    return client.containers.list(filters={
        "label": f"com.docker.swarm.service.name={stack_name(project)}_coordinator"})


# What `live_training_source` reads on each backend (shown by the sweep's display).
LIVE_SOURCES = {"docker": "the coordinator container's log", "local": "the coordinator's log file",
                "swarm": "the coordinator task's container log"}


def live_training_source(backend_name: str, run_dir: Path, project: str = PROJECT) -> Callable[[], Training] | None:
    """How to read the running point's coordinator progress during a sweep, per backend, or None.

    - ``docker``: the coordinator container's log tail (`coordinator_training`), one docker client
      made on the first call;
    - ``swarm``: the log tail of the stack's coordinator task container on this node;
    - ``local``: the coordinator process's log file, ``<run_dir>/logs/coordinator.log``, as the local
      backend writes it (`log_file_training`);
    - any other backend: None (no live figures).

    The function returned never raises: a read that fails gives ``Training()``.
    """
    if backend_name == "local":
        path = Path(run_dir) / "logs" / "coordinator.log"
        return lambda: log_file_training(path)
    if backend_name in ("docker", "swarm"):
        clients: list = []
        found: list = []  # the coordinator's container, listed once (a list and an inspect cost dockerd more than the logs)

        def read() -> Training:
            try:
                if not clients:
                    clients.append(docker_client(timeout_s=5, ping=False))
                if not found:
                    found.extend(_coordinator_containers(clients[0], backend_name, project)[:1])
                training = container_log_training(found[0]) if found else Training()
                if training == Training():  # the container is gone or not yet talking: list it again next time
                    found.clear()
                return training
            except Exception:  # ClusterError or a transport error: no figure this time
                return Training()
        return read
    return None
