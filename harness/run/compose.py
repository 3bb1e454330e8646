"""The Docker backend: one coordinator and N worker containers as ``compose.yaml`` describes them.

The services of compose.yaml are created through the Docker Engine API (`harness.run.compose_file`:
the network, the coordinator, then the workers in parallel), with Compose's own labels and names, so
no Compose binary is needed and ``docker-compose -p PROJECT ps`` still sees the cluster. Container
stats come from the Engine API through the docker SDK (one streaming reader per container), turned
into figures with docker's own CLI formulas (`harness.run.stats`). Every container and the network
carry the Compose project label, so teardown (`cluster_down`) finds what a killed run left behind.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Sequence

from harness import REPO_ROOT
from harness.errors import ClusterError
from harness.links.plan import Capabilities
from harness.run.backend import Collected, PhaseClock, Progress
from harness.run.compose_file import (
    NETWORK_LABEL,
    PROJECT_LABEL,
    SERVICE_LABEL,
    load_project,
)
from harness.run.docker_client import docker_client
from harness.run.faults import Controller
from harness.run.image import DEFAULT_TAG
from harness.run.shaping import START_GATE_FILE, ClusterConditions
from harness.run.stats import parse_sample, summarize_samples
from harness.run.tc_exec import probe_capabilities
from harness.spec.cluster import ClusterSettings
from harness.spec.faults import Fault
from wiiide.auth import generate_secret
from wiiide.config import RunConfig

PROJECT = os.environ.get("WIIIIIDE_PROJECT", "wiiide")
COMPOSE_FILE = REPO_ROOT / "compose.yaml"
DEFAULT_IMAGE = DEFAULT_TAG  # wiiide:latest, or $WIIIIIDE_IMAGE
SECRET_FILE = REPO_ROOT / "build" / "secrets" / f"{PROJECT}-secret"


def compose_env(cfg: RunConfig, results_dir: Path, image: str) -> dict[str, str]:
    """The environment Compose substitutes into compose.yaml: the run's WIIIIIDE_* knobs."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WIIIIIDE_")}
    node_env = cfg.to_env()
    for key in ("WIIIIIDE_COORDINATOR_HOST", "WIIIIIDE_BIND_HOST", "WIIIIIDE_METRICS_DIR",
                "WIIIIIDE_READY_FILE", "WIIIIIDE_NODE_ID"):
        node_env.pop(key, None)  # fixed per service in compose.yaml
    env.update(node_env)
    env["WIIIIIDE_RESULTS_DIR"] = str(results_dir)
    env["WIIIIIDE_IMAGE"] = image
    env["WIIIIIDE_SECRET_FILE_HOST"] = str(SECRET_FILE)
    return env


def write_cluster_secret() -> Path:
    """A fresh shared secret for the next cluster (wiiide.auth), in a 0600 file Compose mounts as a
    Docker secret. It stays out of the reports and out of `docker inspect`."""
    SECRET_FILE.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(SECRET_FILE, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(generate_secret() + "\n")
    return SECRET_FILE


def project_containers(client=None) -> list:
    """Every container (running or not) with the project's Compose label, as docker SDK objects.

    Raises:
        ClusterError: no engine answers (when `client` is None).
    """
    client = client or docker_client()
    return client.containers.list(all=True, filters={"label": f"{PROJECT_LABEL}={PROJECT}"})


def cluster_up(cfg: RunConfig, results_dir: Path, image: str = DEFAULT_IMAGE,
               extra_env: dict[str, str] | None = None) -> list:
    """Start the project's coordinator and `cfg.num_workers` workers, detached; return the containers
    (docker SDK objects, the coordinator first, then workers 1..N).

    The services are those of compose.yaml (`harness.run.compose_file`), created through the Engine
    API: the network, the coordinator, then every worker in parallel without waiting for the
    coordinator's healthcheck (a worker retries connecting for ``connect_timeout_s``). Workers get
    the coordinator's address in /etc/hosts (``extra_hosts``) besides the network's DNS alias.
    `extra_env`: more compose.yaml variables (e.g. WIIIIIDE_WORKER_CPUS from `ClusterSettings.compose_env`).

    Raises:
        ClusterError: compose.yaml cannot be read, or the engine refused a network or container
            (with its message); whatever was created is left for `cluster_down`.
    """
    results_dir.mkdir(parents=True, exist_ok=True)
    (results_dir / "nodes").mkdir(exist_ok=True)
    write_cluster_secret()
    project = load_project(COMPOSE_FILE, PROJECT,
                           {**compose_env(cfg, results_dir.resolve(), image), **(extra_env or {})})
    client = docker_client()
    try:
        client.networks.create(project.network_name, driver="bridge",
                               labels={**project.labels(), NETWORK_LABEL: project.network})
    except Exception as exc:  # docker.errors.APIError: e.g. a leftover of the same name
        raise ClusterError(f"cannot create network {project.network_name}: {exc}") from None

    def start(item: tuple[str, int], extra_hosts: dict[str, str] | None = None):
        service, number = item
        kwargs = project.create_kwargs(service, number)
        if extra_hosts:
            kwargs["extra_hosts"] = extra_hosts
        aliases = [service] + ([kwargs["hostname"]] if kwargs.get("hostname") else [])
        kwargs["networking_config"] = {project.network_name: client.api.create_endpoint_config(aliases=aliases)}
        try:
            container = client.containers.create(**kwargs)
            container.start()
        except Exception as exc:  # docker.errors.APIError / ImageNotFound
            raise ClusterError(f"cannot start {kwargs['name']} from {kwargs['image']}: {exc}") from None
        return container

    coordinator = start(("coordinator", 1))
    coordinator.reload()
    address = (coordinator.attrs["NetworkSettings"]["Networks"].get(project.network_name) or {}).get("IPAddress")
    # workers find the coordinator in their /etc/hosts, not only through the engine's embedded DNS,
    # which was seen to answer NXDOMAIN for a whole run while the shared engine's Swarm state changed
    hosts = {"coordinator": address} if address else {}
    workers = [("worker", i) for i in range(1, cfg.num_workers + 1)]
    with ThreadPoolExecutor(max_workers=max(1, min(PARALLEL_CALLS, len(workers)))) as pool:
        return [coordinator, *pool.map(lambda item: start(item, hosts), workers)]


DOWN_GRACE_S = 5  # seconds a running node has after SIGTERM before SIGKILL, as `compose down --timeout 5`
PARALLEL_CALLS = 8  # Engine API calls in flight at once when stopping and removing containers


def _in_parallel(action: Callable[[Any], None], items: list) -> list[str]:
    """Run `action(item)` for every item on up to `PARALLEL_CALLS` threads; return one line per
    failure (``"<name>: <error>"``) instead of raising, so one stuck container does not keep the rest."""
    def attempt(item) -> str | None:
        try:
            action(item)
        except Exception as exc:  # docker.errors.NotFound (already gone) and APIError: report, go on
            if type(exc).__name__ == "NotFound":
                return None
            return f"{getattr(item, 'name', item)}: {exc}"
        return None

    if not items:
        return []
    with ThreadPoolExecutor(max_workers=min(PARALLEL_CALLS, len(items))) as pool:
        return [line for line in pool.map(attempt, items) if line]


def cluster_down(progress: Progress = print, grace_s: float = DOWN_GRACE_S) -> None:
    """Remove every container and network of the project (Compose project label), leftovers of a
    killed run included, through the Engine API, in parallel.

    Running containers get SIGTERM and `grace_s` seconds before SIGKILL (as ``compose down --timeout
    5``); exited ones are removed at once, with their anonymous volumes. Qdiscs and ifb devices live
    in the containers' network namespaces and go with them. Nothing to remove costs one API call.

    Raises:
        ClusterError: no engine answers, or something of the project is still there afterwards.
    """
    client = docker_client()
    containers = project_containers(client)
    running = [c for c in containers if c.status in ("running", "restarting")]
    problems = _in_parallel(lambda c: c.stop(timeout=int(grace_s)), running)
    problems += _in_parallel(lambda c: c.remove(force=True, v=True), containers)
    problems += _in_parallel(lambda n: n.remove(), client.networks.list(filters={"label": f"{PROJECT_LABEL}={PROJECT}"}))
    for line in problems:
        progress(f"    cluster down: {line}")
    left = [c.name for c in project_containers(client)]
    left += [f"network {n.name}" for n in client.networks.list(filters={"label": f"{PROJECT_LABEL}={PROJECT}"})]
    if left:
        raise ClusterError(f"cluster down: {', '.join(left)} of project {PROJECT} still there: "
                           f"{'; '.join(problems) or 'no error given'}")


class _StatsReader:
    """Streams one container's Engine API stats on a daemon thread into parsed samples."""

    def __init__(self, container, t0: float) -> None:
        self.container = container
        self.samples: list[dict[str, Any]] = []
        self._t0 = t0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        try:
            for raw in self.container.stats(stream=True, decode=True):
                if self._stop.is_set():
                    return
                record = parse_sample(raw, time.monotonic() - self._t0)
                if record is not None:
                    self.samples.append(record)
        except Exception:  # the container went away: the stream ends, keep what we have
            return

    def stop(self) -> None:
        """Keep no sample from now on. Returns at once: the thread, blocked on the stream until the
        next sample (about a second), ends by itself, at the latest when the container is removed."""
        self._stop.set()


def _lifetime(container) -> dict[str, str | None]:
    """When the container's main process started and finished (UTC, RFC 3339 as the Engine API gives
    it; None when not yet), from ``State.StartedAt`` / ``State.FinishedAt``."""
    state = container.attrs.get("State") or {}

    def stamp(key: str) -> str | None:
        value = state.get(key)
        return None if not value or value.startswith("0001-") else value

    return {"started_at_utc": stamp("StartedAt"), "finished_at_utc": stamp("FinishedAt")}


class _ContainerController:
    """Fault actions on the project's containers (harness.run.faults.Controller), through the Engine API.

    `disconnect` sets the target's eth0 down inside it (``ip link``, NET_ADMIN) and `reconnect` up
    again: the address and its connected route stay, so TCP connections survive a cut shorter than
    io_timeout_s and are declared lost after it.
    """

    def __init__(self, containers: list) -> None:
        self._by_target = {}
        for c in containers:
            service = c.labels.get(SERVICE_LABEL)
            number = c.labels.get("com.docker.compose.container-number", "1")
            self._by_target["coordinator" if service == "coordinator" else f"worker-{number}"] = c

    def _get(self, target: str):
        try:
            return self._by_target[target]
        except KeyError:
            raise ClusterError(f"no container for {target}; have {sorted(self._by_target)}") from None

    def kill(self, target: str) -> None:
        """SIGKILL the target's container."""
        self._get(target).kill()

    def restart(self, target: str) -> None:
        """Start the target's (killed) container again."""
        self._get(target).start()

    def pause(self, target: str) -> None:
        """Freeze the target's container (cgroup freezer)."""
        self._get(target).pause()

    def resume(self, target: str) -> None:
        """Thaw the target's container."""
        self._get(target).unpause()

    def _link(self, target: str, state: str) -> None:
        code, out = self._get(target).exec_run(["ip", "link", "set", "eth0", state])
        if code != 0:
            raise ClusterError(f"`ip link set eth0 {state}` in {target} failed ({code}): {out.decode(errors='replace')[:300]}")

    def node_id(self, target: str) -> str:
        """The target's node id: its container's hostname."""
        return self._get(target).attrs["Config"]["Hostname"]  # a worker's node id is its hostname

    def disconnect(self, target: str) -> None:
        """Set the target's eth0 down (ClusterError when `ip` fails)."""
        self._link(target, "down")

    def reconnect(self, target: str) -> None:
        """Set the target's eth0 up again (ClusterError when `ip` fails)."""
        self._link(target, "up")


class ComposeBackend:
    """The ``docker`` `harness.run.backend.Backend`: a coordinator and N worker containers from
    ``compose.yaml`` under the Compose project `PROJECT`, with links, limits and every fault."""

    name = "docker"

    def __init__(self, image_tag: str | None = None) -> None:
        """Raises ClusterError when no Docker engine answers."""
        self.image = image_tag or DEFAULT_IMAGE
        self.client = docker_client()
        self._started = False
        self._containers: list = []
        self._readers: dict[str, _StatsReader] = {}
        self._conditions: ClusterConditions | None = None

    def prepare(self, progress: Progress) -> None:
        """(Re)build the image: minutes the first time, seconds when cached, and never a stale copy of
        `wiiide/`.

        Raises:
            ClusterError: the image cannot be built.
        """
        from harness.run.image import build_image
        build_image(self.image, log=lambda line: progress(f"    image: {line}"))

    def describe(self) -> dict[str, Any]:
        """Engine and API versions, how containers are made, the image, the project, the storage driver."""
        version = self.client.version()
        return {"name": self.name, "engine_version": version.get("Version"), "api_version": version.get("ApiVersion"),
                "compose": "compose.yaml through the Engine API (harness.run.compose_file)", "image": self.image,
                "project": PROJECT, "storage_driver": self.client.info().get("Driver")}

    def check_cluster(self, cluster: ClusterSettings | None) -> None:
        """Links, CPU and memory limits: all applied here (harness.run.shaping); never raises."""

    def check_faults(self, faults: Sequence[Fault]) -> None:
        """Every fault action works on containers; never raises."""

    def _probe(self) -> Capabilities:
        return probe_capabilities(self.client, self.image, {PROJECT_LABEL: PROJECT})

    def launch(self, cfg: RunConfig, out_dir: Path, cluster: ClusterSettings, progress: Progress,
               clock: PhaseClock | None = None) -> list:
        """Bring a cluster up as a sweep run does, without watching it: remove leftovers of the
        project, plan the link shaping (probing the kernel once), start the containers, then set
        limits, shape links and open the start gate. Each step is timed on `clock` (if given).
        `wiiide-lab up` uses it for a long-running cluster; `start` for a sweep's run.

        Returns:
            The project's containers (docker SDK objects), coordinator and workers.

        Raises:
            ClusterError: Compose or the engine failed, or a limit could not be set.
            LinkShapingError: a link profile cannot be applied (before any container starts, when
                the kernel lacks a qdisc; else with the tc command and its message).
        """
        clock = clock or PhaseClock()
        conditions = self._conditions = ClusterConditions(cluster, self._probe)
        with clock.phase("clean"):
            cluster_down(progress)  # a clean slate: nothing left from an earlier, killed run
        self._started = True
        with clock.phase("plan"):
            conditions.plan(cfg.num_workers)  # before any container starts: a profile the kernel cannot apply fails here
        if conditions.gated:  # the coordinator waits until links and limits are in force
            cfg = cfg.replace(start_gate_file=START_GATE_FILE)
        with clock.phase("create"):
            self._containers = cluster_up(cfg, out_dir, self.image, conditions.settings.compose_env())
        if conditions.gated:
            with clock.phase("shape"):
                conditions.apply(self._containers, clock.t0, progress)
            with clock.phase("gate"):
                conditions.open_gate(self._containers, clock.t0)
        return self._containers

    def start(self, cfg: RunConfig, out_dir: Path, cluster: ClusterSettings, progress: Progress,
              clock: PhaseClock) -> Controller:
        """`launch` the cluster and stream every container's Engine API stats until `stop`.

        Raises:
            ClusterError, LinkShapingError: as `launch`.
        """
        containers = self.launch(cfg, out_dir, cluster, progress, clock)
        for c in containers:
            self._readers[c.name] = _StatsReader(c, clock.t0)
        return _ContainerController(containers)

    def poll(self) -> dict[str, str]:
        """Each container's state (``running``, ``exited``, ``paused``...), from one Engine API list call."""
        listed = {name.lstrip("/"): item.get("State") for item in self.client.api.containers(
            all=True, filters={"label": f"{PROJECT_LABEL}={PROJECT}"}) for name in item.get("Names") or ()}
        return {c.name: listed.get(c.name, "exited") for c in self._containers}  # a removed one has exited

    def exit_code(self, name: str) -> int | None:
        """Container `name`'s exit code once it has exited; None while it runs, or when it cannot be read."""
        for c in self._containers:
            if c.name == name:
                try:
                    c.reload()
                except Exception:  # gone or the engine busy: unknown, the next poll asks again
                    return None
                return c.attrs["State"]["ExitCode"] if c.status in ("exited", "dead") else None
        return None

    def stop(self) -> None:
        """Stop reading link counters and container stats."""
        if self._conditions is not None:
            self._conditions.stop()
        for reader in self._readers.values():
            reader.stop()

    def collect(self, logs_dir: Path, progress: Progress) -> Collected:
        """Exit codes (None: still running), each container's log into `logs_dir`, stats, links, limits."""
        exit_codes: dict[str, int | None] = {}
        for c in self._containers:
            try:
                c.reload()
                exit_codes[c.name] = c.attrs["State"]["ExitCode"] if c.status in ("exited", "dead") else None
                (logs_dir / f"{c.name}.log").write_bytes(c.logs(stdout=True, stderr=True))
            except Exception as exc:  # a container already gone: note it, keep going
                exit_codes.setdefault(c.name, None)
                progress(f"    could not read {c.name}: {exc}")
        stats = {c.name: {"role": c.labels.get(SERVICE_LABEL, "?"), "kind": "container",
                          "exit_code": exit_codes.get(c.name), **_lifetime(c),
                          "samples": self._readers[c.name].samples,
                          "summary": summarize_samples(self._readers[c.name].samples)}
                 for c in self._containers if c.name in self._readers}
        conditions = self._conditions
        return Collected(exit_codes=exit_codes, containers=stats,
                         links=conditions.links if conditions else {}, limits=conditions.limits if conditions else {})

    def teardown(self) -> None:
        """Remove the project's containers and network (`cluster_down`) if this backend started any."""
        self.stop()
        self._containers, self._readers, self._conditions = [], {}, None
        if self._started:
            cluster_down(lambda line: None)
            self._started = False
