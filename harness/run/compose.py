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
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Sequence

from harness import REPO_ROOT
from harness.errors import ClusterError
from harness.links.plan import Capabilities
from harness.run.backend import (
    ENGINE_POLL_INTERVAL_S,
    Collected,
    PhaseClock,
    Progress,
    refuse_overlay_encrypted,
)
from harness.run.certs import config_fields, write_cluster_tls
from harness.run.compose_file import (
    NETWORK_LABEL,
    NUMBER_LABEL,
    PROJECT_LABEL,
    SERVICE_LABEL,
    load_project,
)
from harness.run.docker_client import docker_client
from harness.run.faults import ContainerController, Controller
from harness.run.image import DEFAULT_TAG
from harness.run.shaping import START_GATE_FILE, ClusterConditions
from harness.run.stats import (
    StatsReader,
    container_lifetime,
    since_baseline,
    start_readers,
    stop_readers,
    summarize_samples,
)
from harness.run.tc_exec import ContainerExec, probe_capabilities, reset_links
from harness.run.zygote_pool import ZygotePool, pool_key, results_root
from harness.spec.cluster import ClusterSettings
from harness.spec.faults import Fault
from wiiide.config import RunConfig
from wiiide.wire.auth import generate_secret

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


ZYGOTE_MOUNT = "/zygote"  # where a warm node's control directory is mounted (wiiide.zygote.CONTROL_DIR)
ZYGOTE_SLOT_ENV = "NODE_ZYGOTE_SLOT"  # wiiide.zygote.SLOT_ENV


def slot_name(service: str, number: int) -> str:
    """A node's slot: ``coordinator``, or ``worker-N`` for container number N of the worker service."""
    return "coordinator" if service == "coordinator" else f"{service}-{number}"

CONTAINER_TLS_DIR = "/results/tls"  # where a container finds its node's ca.crt, node.crt, node.key


def write_docker_tls(cfg: RunConfig, results_dir: Path) -> tuple[RunConfig, Path]:
    """A fresh CA and node certificates under ``results_dir/tls`` (`harness.run.certs`): the
    coordinator's names ``coordinator`` (what workers dial) and its container name, each worker's
    ``worker-N`` and its container name. Returns `cfg` with the three file fields pointing into
    `CONTAINER_TLS_DIR`, and the folder for `cluster_up`'s `tls_dir`. Raises HarnessError."""
    names = {"coordinator": ["coordinator", f"{PROJECT}_coordinator_1"],
             **{slot_name("worker", i): [slot_name("worker", i), f"{PROJECT}_worker_{i}"]
                for i in range(1, cfg.num_workers + 1)}}
    folder = (results_dir / "tls").resolve()
    write_cluster_tls(folder, names, PROJECT)
    return cfg.replace(**config_fields(CONTAINER_TLS_DIR)), folder


def write_cluster_secret() -> Path:
    """A fresh shared secret for the next cluster (wiiide.wire.auth), in a 0600 file Compose mounts as a
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
    # ignore_removed: a container removed between the list and its inspect (a run ending) is skipped,
    # not docker.errors.NotFound
    return client.containers.list(all=True, filters={"label": f"{PROJECT_LABEL}={PROJECT}"}, ignore_removed=True)


def cluster_up(cfg: RunConfig, results_dir: Path, image: str = DEFAULT_IMAGE,
               extra_env: dict[str, str] | None = None, zygote_dir: Path | None = None,
               tls_dir: Path | None = None) -> list:
    """Start the project's coordinator and `cfg.num_workers` workers, detached; return the containers
    (docker SDK objects, the coordinator first, then workers 1..N).

    The services are those of compose.yaml (`harness.run.compose_file`), created through the Engine
    API: the network, the coordinator, then every worker in parallel without waiting for the
    coordinator's healthcheck (a worker retries connecting for ``connect_timeout_s``). Workers get
    the coordinator's address in /etc/hosts (``extra_hosts``) besides the network's DNS alias.
    `extra_env`: more compose.yaml variables (e.g. WIIIIIDE_WORKER_CPUS from `ClusterSettings.compose_env`).
    `zygote_dir`: run every node as a warm `wiiide.zygote` instead (its control directory, on the host,
    mounted at ``/zygote``): the containers import torch, then wait for run requests (`ZygotePool`).
    `tls_dir`: `write_docker_tls`'s folder: each container mounts its own node's sub-folder read-only at
    `CONTAINER_TLS_DIR`, over the run folder's ``tls`` (so it sees no other node's key).

    Raises:
        ClusterError: compose.yaml cannot be read, or the engine refused a network or container
            (with its message); whatever was created is left for `cluster_down`.
    """
    results_dir.mkdir(parents=True, exist_ok=True)
    if zygote_dir is None:
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
        if tls_dir is not None:
            kwargs["volumes"].append(f"{tls_dir / slot_name(service, number)}:{CONTAINER_TLS_DIR}:ro")
        if extra_hosts:
            kwargs["extra_hosts"] = extra_hosts
        if zygote_dir is not None:
            kwargs["command"] = ["python", "-m", "wiiide.zygote", service]
            kwargs["volumes"] = [*kwargs["volumes"], f"{zygote_dir}:{ZYGOTE_MOUNT}"]
            kwargs["environment"] = {**kwargs["environment"], ZYGOTE_SLOT_ENV: slot_name(service, number)}
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
    if not workers:
        return [coordinator]
    with ThreadPoolExecutor(max_workers=max(1, min(PARALLEL_CALLS, len(workers)))) as pool:
        return [coordinator, *pool.map(lambda item: start(item, hosts), workers)]


DOWN_GRACE_S = 5  # seconds a running node has after SIGTERM before SIGKILL, as `compose down --timeout 5`
# A network the engine will not remove for "active endpoints" once no container is left: dockerd (20.10
# on the harness machine, 2026-11-25) kept an endpoint of a removed container, and only its restart dropped it ("Fixing
# inconsistent endpoint_cnt for network ..." in its log). The harness does not restart an engine.
STALE_ENDPOINT_HINT = (". The engine still counts an endpoint of a removed container on that network: restart it "
                       "(`make docker-engine-stop docker-engine` when `make docker-engine` started it) and run "
                       "`python -m harness down` again")
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
        hint = STALE_ENDPOINT_HINT if any("active endpoints" in line for line in problems) else ""
        raise ClusterError(f"cluster down: {', '.join(left)} of project {PROJECT} still there: "
                           f"{'; '.join(problems) or 'no error given'}{hint}")


ZYGOTE_ROOT = REPO_ROOT / "build" / "zygote"  # control directories of warm pools, one per project


class ComposeBackend:
    """The ``docker`` `harness.run.backend.Backend`: a coordinator and N worker containers from
    ``compose.yaml`` under the Compose project `PROJECT`, with links, limits and every fault.

    `reuse`: keep warm containers between runs (`harness.run.zygote_pool`): the first run of a
    cluster creates containers whose nodes are `wiiide.zygote`s (torch imported once), each run forks
    fresh node processes in them, and a run that ended clean leaves them for the next run of the same
    cluster; `close` removes them. False (the default for library use and ``up``): fresh containers
    per run, each running ``python -m wiiide <role>`` as compose.yaml says.
    """

    name = "docker"
    poll_interval_s = ENGINE_POLL_INTERVAL_S

    def __init__(self, image_tag: str | None = None, reuse: bool = False) -> None:
        """Raises ClusterError when no Docker engine answers."""
        self.image = image_tag or DEFAULT_IMAGE
        self.client = docker_client()
        self.reuse = reuse
        self.last_run_reused = False  # whether the last `start` found warm containers to reuse
        self._pool = ZygotePool(ZYGOTE_ROOT / PROJECT) if reuse else None
        self._started = False
        self._containers: list = []
        self._readers: dict[str, StatsReader] = {}
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
        """Engine and API versions, how containers are made, the image, the project, the storage driver,
        whether warm containers are reused between runs."""
        version = self.client.version()
        return {"name": self.name, "engine_version": version.get("Version"), "api_version": version.get("ApiVersion"),
                "compose": "compose.yaml through the Engine API (harness.run.compose_file)", "image": self.image,
                "project": PROJECT, "storage_driver": self.client.info().get("Driver"),
                "reuse_containers": self.reuse}

    @classmethod
    def check_cluster(cls, cluster: ClusterSettings | None) -> None:
        """Links, CPU and memory limits: all applied here (harness.run.shaping). Raises ClusterError
        for ``overlay_encrypted`` (a bridge network: swarm only)."""
        refuse_overlay_encrypted(cls.name, cluster)

    @classmethod
    def check_faults(cls, faults: Sequence[Fault]) -> None:
        """Every fault action works on containers; never raises."""

    def _probe(self) -> Capabilities:
        return probe_capabilities(self.client, self.image, {PROJECT_LABEL: PROJECT})

    def launch(self, cfg: RunConfig, out_dir: Path, cluster: ClusterSettings, progress: Progress,
               clock: PhaseClock | None = None) -> list:
        """Bring a cluster up as a sweep run does, without watching it: remove leftovers of the
        project, plan the link shaping (probing the kernel once), start the containers, then set
        limits, shape links and open the start gate (`ClusterConditions.bring_up`). Each step is timed
        on `clock` (if given). `wiiide-lab up` uses it for a long-running cluster; `start` for a
        sweep's run without `reuse`.

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
        tls_dir = None
        if cfg.tls:  # a fresh CA and node certificates in the run folder, each container mounting its own
            cfg, tls_dir = write_docker_tls(cfg, out_dir)

        def create(cfg: RunConfig) -> list:
            self._containers = cluster_up(cfg, out_dir, self.image, conditions.settings.compose_env(),
                                          tls_dir=tls_dir)
            return self._containers

        return conditions.bring_up(cfg, clock, create, progress)

    def start(self, cfg: RunConfig, out_dir: Path, cluster: ClusterSettings, progress: Progress,
              clock: PhaseClock) -> Controller:
        """Start the run's nodes (fresh containers with `launch`, or forked in warm ones with `reuse`)
        and stream every container's Engine API stats until `stop`.

        Raises:
            ClusterError, LinkShapingError: as `launch`.
        """
        if self._pool is not None:
            return self._start_warm(cfg, Path(out_dir).resolve(), cluster, progress, clock)
        containers = self.launch(cfg, out_dir, cluster, progress, clock)
        self._readers = start_readers(containers, clock.t0)
        return ContainerController(containers)

    def _start_warm(self, cfg: RunConfig, out_dir: Path, cluster: ClusterSettings, progress: Progress,
                    clock: PhaseClock) -> Controller:
        """`start` with warm containers: reuse the pool when it was made for this cluster and all its
        containers run, else make a new one (``clean``, then ``create`` with zygotes); per run: a fresh
        secret, stats baselines, the request that forks every node, then shaping and the gate."""
        pool = self._pool
        assert pool is not None
        root = results_root(out_dir)
        route_congestion = cfg.tcp_congestion if cfg.engine in ("ddp", "fsdp") else ""  # on the routes: kept
        key = pool_key(self.image, cfg.num_workers, cluster, root, route_congestion)
        self.last_run_reused = pool.usable(key) and self._pool_running()
        if not self.last_run_reused:
            with clock.phase("clean"):
                cluster_down(progress)  # a pool made for another cluster, or leftovers of a killed run
                pool.reset()
            self._started = True
        run_id = pool.next_run_id()
        conditions = self._conditions = ClusterConditions(cluster, self._probe, gate_file=f"{START_GATE_FILE}-{run_id}")

        def create(run_cfg: RunConfig) -> list:
            if not self.last_run_reused:
                containers = cluster_up(run_cfg, root, self.image, conditions.settings.compose_env(),
                                        zygote_dir=pool.control_dir.resolve())
                pool.adopt(key, root, containers, {c.name: _slot_of(c) for c in containers})
                self._readers = start_readers(containers, clock.t0)
            else:
                write_cluster_secret()  # a fresh secret per run: the mounted file is rewritten in place
                self._readers = start_readers(pool.containers, clock.t0)
            self._containers = pool.containers
            pool.write_request(self._node_envs(run_cfg, out_dir, root, conditions))
            return self._containers

        def unshape(containers: list) -> None:
            # qdiscs and the ifb device outlive a run in a kept container's netns: shape from scratch
            if self.last_run_reused and conditions.settings.link is not None:
                with ThreadPoolExecutor(max_workers=min(PARALLEL_CALLS, len(containers))) as calls:
                    list(calls.map(lambda c: reset_links(ContainerExec(c)), containers))

        containers = conditions.bring_up(cfg, clock, create, progress, before_shape=unshape)
        return ContainerController(containers, on_action=lambda action, target: pool.mark_dirty(f"{action} {target}"))

    def _node_envs(self, cfg: RunConfig, out_dir: Path, root: Path, conditions: ClusterConditions) -> dict[str, dict[str, str]]:
        """Each role's ``WIIIIIDE_*`` variables for this run, as compose.yaml gives them to a fresh
        container, with the metrics going to ``out_dir/nodes`` (below the pool's mount `root`)."""
        project = load_project(COMPOSE_FILE, PROJECT, {**compose_env(cfg, root, self.image),
                                                       **conditions.settings.compose_env()})
        metrics_dir = f"/results/{out_dir.relative_to(root).as_posix()}/nodes"
        envs = {}
        for role in ("coordinator", "worker"):
            env = {k: v for k, v in project.create_kwargs(role, 1)["environment"].items() if k.startswith("WIIIIIDE_")}
            env["WIIIIIDE_METRICS_DIR"] = metrics_dir
            envs[role] = env
        return envs

    def _listed_states(self) -> dict[str, str]:
        """Container name -> state of every container of the project, from one Engine API list call."""
        return {name.lstrip("/"): item.get("State") for item in self.client.api.containers(
            all=True, filters={"label": f"{PROJECT_LABEL}={PROJECT}"}) for name in item.get("Names") or ()}

    def _pool_running(self) -> bool:
        """Whether every container of the warm pool still runs, the same containers by id (another
        backend of the project, e.g. ``bench-overhead --images``, makes others of the same names)."""
        running = {item.get("Id") for item in self.client.api.containers(
            filters={"label": f"{PROJECT_LABEL}={PROJECT}", "status": "running"})}
        return bool(self._pool and self._pool.containers) and all(c.id in running for c in self._pool.containers)

    def poll(self) -> dict[str, str]:
        """Each node's state (``running``, ``exited``, ``paused``...), from one Engine API list call; in a
        warm container, ``exited`` once its node process of this run has ended (its exit file)."""
        listed = self._listed_states()
        states = {c.name: listed.get(c.name, "exited") for c in self._containers}  # a removed one has exited
        if self._pool is not None:
            for name, state in states.items():
                if state == "running" and self._pool.exit_record(self._pool.slots.get(name, "")) is not None:
                    states[name] = "exited"
        return states

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
        stop_readers(self._readers.values())

    def collect(self, logs_dir: Path, progress: Progress) -> Collected:
        """Exit codes (None: still running), each node's log into `logs_dir`, stats, links, limits.
        With warm containers, the node process's exit code, log and start/end times of this run; the
        pool stays for the next run only when every node exited 0 and nothing touched a container."""
        exit_codes: dict[str, int | None] = {}
        lifetimes: dict[str, dict[str, str | None]] = {}
        pool = self._pool
        for c in self._containers:
            try:
                c.reload()
                exit_codes[c.name] = c.attrs["State"]["ExitCode"] if c.status in ("exited", "dead") else None
                lifetimes[c.name] = container_lifetime(c)
                if pool is not None:
                    slot = pool.slots.get(c.name, "")
                    end, begin = pool.exit_record(slot), pool.start_record(slot)
                    if end is not None and c.status == "running":
                        exit_codes[c.name] = end.get("exit_code")
                    lifetimes[c.name] = {"started_at_utc": (begin or {}).get("started_at_utc"),
                                         "finished_at_utc": (end or {}).get("finished_at_utc")}
                    log = pool.log_bytes(slot)
                    if c.status != "running":  # killed: what the container printed besides its node's output
                        log += c.logs(stdout=True, stderr=True)
                    (logs_dir / f"{c.name}.log").write_bytes(log)
                else:
                    (logs_dir / f"{c.name}.log").write_bytes(c.logs(stdout=True, stderr=True))
            except Exception as exc:  # a container already gone: note it, keep going
                exit_codes.setdefault(c.name, None)
                progress(f"    could not read {c.name}: {exc}")
        if pool is not None and pool.dirty_reason is None:
            pool.clean = bool(self._containers) and all(exit_codes.get(c.name) == 0 for c in self._containers)
        stats = {}
        for c in self._containers:
            if c.name not in self._readers:
                continue
            samples = self._readers[c.name].samples
            if pool is not None and self.last_run_reused:
                # a kept container's counters run from its creation: this run's bytes are those since
                # its node was forked (the zygote read them then; the containers idle between runs)
                baseline = (pool.start_record(pool.slots.get(c.name, "")) or {}).get("counters")
                samples = [since_baseline(s, baseline) for s in samples]
            stats[c.name] = {"role": c.labels.get(SERVICE_LABEL, "?"), "kind": "container",
                             "exit_code": exit_codes.get(c.name), **lifetimes.get(c.name, {}),
                             **({"reused_container": self.last_run_reused} if pool is not None else {}),
                             "samples": samples, "summary": summarize_samples(samples)}
        conditions = self._conditions
        return Collected(exit_codes=exit_codes, containers=stats,
                         links=conditions.links if conditions else {}, limits=conditions.limits if conditions else {})

    def teardown(self) -> None:
        """After a run: remove the project's containers and network (`cluster_down`) if this backend
        started any; with `reuse`, keep them instead when the run ended clean (`collect`)."""
        self.stop()
        self._containers, self._readers, self._conditions = [], {}, None
        pool = self._pool
        if pool is not None and pool.clean:
            pool.end_run()
            return
        if self._started:
            cluster_down(lambda line: None)
            self._started = False
        if pool is not None:
            pool.reset()

    def close(self, progress: Progress = print) -> None:
        """After the last run (also after a failure or Ctrl-C): remove warm containers, the network
        and the control directory. Idempotent.

        Raises:
            ClusterError: something of the project is still there afterwards (`cluster_down`).
        """
        self.stop()
        self._containers, self._readers, self._conditions = [], {}, None
        if self._started:
            cluster_down(progress)
            self._started = False
        if self._pool is not None:
            self._pool.reset()
            shutil.rmtree(self._pool.control_dir, ignore_errors=True)


def _slot_of(container) -> str:
    """A container's slot (`slot_name`) from its Compose labels."""
    return slot_name(container.labels.get(SERVICE_LABEL, "?"), int(container.labels.get(NUMBER_LABEL, "1")))
