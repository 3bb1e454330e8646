"""`SwarmBackend`: one run as a stack, through the run stage's `Backend` protocol (start / poll / stop /
collect / teardown, driven by `harness.run.loop.run_point`); ``launch`` for ``up``, `cluster_down` for
``down``."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Sequence

from harness.errors import ClusterError
from harness.hosts.plan import HOSTS_ENV, max_replicas_per_node
from harness.links.plan import Capabilities
from harness.run.backend import ENGINE_POLL_INTERVAL_S, Collected, PhaseClock, Progress
from harness.run.compose_project import DEFAULT_IMAGE, PROJECT, write_cluster_secret
from harness.run.docker_client import docker_client
from harness.run.faults import ContainerController, Controller
from harness.run.shaping import ClusterConditions
from harness.run.stats import (
    StatsReader,
    container_lifetime,
    start_readers,
    stop_readers,
    summarize_samples,
)
from harness.run.swarm.cluster import ensure_swarm, leave_swarm_if_ours, swarm_info
from harness.run.swarm.stack import (
    STACK_LABEL,
    deploy_stack,
    remove_stack,
    stack_env,
    stack_name,
    write_stack_files,
)
from harness.run.swarm.tasks import (
    COPY_METRICS_ENV,
    NodeEngines,
    TaskContainer,
    check_overlay_eth0,
    copy_node_metrics,
    read_mtu,
    task_containers,
)
from harness.run.tc_exec import probe_capabilities, set_container_paused
from harness.spec.cluster import ClusterSettings
from harness.spec.faults import Fault
from wiiide.config import RunConfig

RUNNING_WAIT_S = 120.0  # seconds after deploy for every task's container to run (image present: ~2 s)
STOP_GRACE_S = 5


class SwarmBackend:
    """The ``swarm`` `harness.run.backend.Backend`: one stack per run on a Docker Swarm (a single node
    unless hosts joined), with links, limits and the kill, pause and disconnect faults.

    `close` (the end of a sweep) leaves a swarm the harness started.
    """

    name = "swarm"
    poll_interval_s = ENGINE_POLL_INTERVAL_S

    def __init__(self, image_tag: str | None = None, progress: Progress = print) -> None:
        """Raises ClusterError when no Docker engine answers. The swarm is joined or started later, by
        `describe` or the first `start` (so a spec refused by the checks leaves the engine untouched)."""
        self.image = self.node_image = image_tag or os.environ.get("WIIIIIDE_IMAGE", DEFAULT_IMAGE)
        self._hosts = None  # harness.hosts.engines.Hosts: on the hosts of `hosts up` (--hosts)
        if os.environ.get(HOSTS_ENV) == "1":
            from harness.hosts.engines import attach
            self._hosts = attach()
            self.image = self._hosts.plan.image_in_registry(self.node_image)  # as the hosts pull it
            self.client = docker_client(base_url=self._hosts.manager_url)
        else:
            self.client = docker_client()
        self.stack = stack_name()
        self.started_swarm = False
        self._progress = progress
        self._engines: NodeEngines | None = None
        self._containers: list[TaskContainer] = []
        self._readers: dict[str, StatsReader] = {}
        self._conditions: ClusterConditions | None = None
        self._deployed = False
        self._image_pushed = False

    @property
    def engines(self) -> NodeEngines:
        """The swarm's node engines; the first use makes sure the engine is in a swarm (`ensure_swarm`).

        Raises:
            ClusterError: see `ensure_swarm`.
        """
        if self._engines is None:
            self.started_swarm = ensure_swarm(self.client, self._progress)
            self._engines = NodeEngines(self.client, self._hosts.endpoints() if self._hosts else None)
        return self._engines

    def prepare(self, progress: Progress) -> None:
        """(Re)build the image on this node (the others need it from a registry: see docs/multi-host.md);
        on the hosts of ``hosts up``, then push it to their registry and pull it on each.

        Raises:
            ClusterError: the image cannot be built, pushed or pulled.
        """
        from harness.run.image import build_image
        build_image(self.node_image, log=lambda line: progress(f"    image: {line}"))
        if self._hosts is not None:
            self._image_pushed = False
            self._share_image(progress)

    def describe(self) -> dict[str, Any]:
        """Engine version, the swarm (nodes, whether the harness started it), the stack, the image.
        Joins or starts the swarm first (`engines`); raises ClusterError when it cannot."""
        self.engines
        version = self.client.version()
        info = swarm_info(self.client)
        hosts = ({"hosts": list(self._hosts.urls), "registry": self._hosts.registry_address}
                 if self._hosts else {})
        return {"name": self.name, "engine_version": version.get("Version"), "api_version": version.get("ApiVersion"),
                **hosts,
                "image": self.image, "project": PROJECT, "stack": self.stack,
                "swarm_nodes": info.get("Nodes"), "swarm_managers": info.get("Managers"),
                "swarm_started_by_harness": self.started_swarm, "network": "overlay (VXLAN), internal",
                "storage_driver": self.client.info().get("Driver")}

    @classmethod
    def check_cluster(cls, cluster: ClusterSettings | None) -> None:
        """Links, CPU and memory limits are applied in each task's container (as on ``docker``), and
        ``overlay_encrypted`` on the stack's network (`harness.run.swarm.stack.stack_override`): never raises."""

    @classmethod
    def check_faults(cls, faults: Sequence[Fault]) -> None:
        """``restart`` is refused (ClusterError): Swarm does not restart a task's container, it replaces
        the task, and with ``restart_policy: none`` a killed task stays down. kill, pause and disconnect work."""
        if any(f.action == "restart" for f in faults or ()):
            raise ClusterError("the swarm backend cannot restart a killed node: Swarm replaces tasks rather than "
                               "restarting their containers, and the stack's restart_policy is none; "
                               "use --backend docker for `restart` faults")

    def _probe(self) -> Capabilities:
        return probe_capabilities(self.client, self.image, {STACK_LABEL: self.stack})

    # ---- the steps of one run
    def launch(self, cfg: RunConfig, out_dir: Path, cluster: ClusterSettings, progress: Progress,
               clock: PhaseClock | None = None) -> list[TaskContainer]:
        """Bring the stack up as a sweep run does, without watching it: join or start the swarm, remove
        a leftover stack, plan the link shaping, deploy, wait until every task's container runs, then
        set limits, shape links and open the start gate. Each step is timed on `clock` (if given).
        ``up --backend swarm`` uses it for a long-running stack; `start` for a sweep's run.

        Returns:
            The tasks' containers (`TaskContainer`), the coordinator first, then workers by slot.

        Raises:
            ClusterError: the swarm cannot be had, the stack could not be deployed, a task failed or
                did not run within `RUNNING_WAIT_S` seconds, or a limit could not be set.
            LinkShapingError: a link profile cannot be applied (before anything is deployed when the
                kernel lacks a qdisc), or eth0 of a task is not its overlay interface.
        """
        if cfg.tls:  # replicas of one service share one spec: no per-node certificate without per-task secrets
            raise ClusterError("tls: true runs on the docker and local backends; on swarm, encrypt the overlay "
                               "network instead (overlay_encrypted: true, IPsec between hosts) or use --backend docker")
        clock = clock or PhaseClock()
        out_dir = Path(out_dir).resolve()
        (out_dir / "nodes").mkdir(parents=True, exist_ok=True)
        self._conditions = conditions = ClusterConditions(cluster or ClusterSettings(), self._probe)
        with clock.phase("clean"):
            self.engines  # the swarm: joined, or started on this node
            remove_stack(self.client, self.stack, progress)  # a clean slate: nothing left from a killed run
            if self._hosts is not None:  # the image on every host before the link probe runs it there
                from harness.hosts.engines import prepare_path
                self._share_image(progress)
                prepare_path(self._hosts, str(out_dir / "nodes"))  # each task's bind mount, on its own host

        def create(cfg: RunConfig) -> list[TaskContainer]:
            self._share_image(progress)
            spread = max_replicas_per_node(cfg.num_workers, len(self._hosts.urls)) if self._hosts else None
            files = write_stack_files(out_dir / "swarm", cfg.num_workers,
                                      encrypted=conditions.settings.overlay_encrypted, max_replicas_per_node=spread)
            write_cluster_secret()
            self._deployed = True
            env = stack_env(cfg, out_dir, self.image, conditions.settings.compose_env())
            if self._hosts is not None:  # `docker stack deploy` talks to the hosts' manager
                env["DOCKER_HOST"] = self._hosts.manager_url
            deploy_stack(files, self.stack, env)
            self._containers = self._wait_running(cfg.num_workers)
            for c in self._containers:
                c.overlay_mtu_bytes = read_mtu(c)
            return self._containers

        def check_eth0(containers: list[TaskContainer]) -> None:
            if conditions.settings.link is not None:
                for c in containers:
                    check_overlay_eth0(c, self.stack)

        conditions.bring_up(cfg, clock, create, progress, before_shape=check_eth0)
        return self._containers

    def start(self, cfg: RunConfig, out_dir: Path, cluster: ClusterSettings, progress: Progress,
              clock: PhaseClock) -> Controller:
        """`launch` the stack and stream every task's Engine API stats until `stop`; return the fault
        controller (kill, pause, disconnect through the task's container).

        Raises:
            ClusterError, LinkShapingError: as `launch`.
        """
        containers = self.launch(cfg, out_dir, cluster, progress, clock)
        self._readers = start_readers(containers, clock.t0)
        return ContainerController(containers)

    def _share_image(self, progress: Progress) -> None:
        """On a swarm of several nodes, push the image once to the registry its name points at (the
        other nodes pull it from there); on one node nothing is needed.

        Raises:
            ClusterError: several nodes and an image name with no registry (``wiiide:latest``), or the push failed.
        """
        nodes = swarm_info(self.client).get("Nodes") or 1
        if self._image_pushed:
            return
        if self._hosts is not None:
            from harness.hosts.engines import distribute_image
            distribute_image(self._hosts, self.node_image, progress)
            self._image_pushed = True
            return
        if nodes <= 1:
            return
        repo, sep, tag = self.image.rpartition(":")
        if not sep or "/" in tag:  # no tag (a colon, if any, is a registry's port)
            repo, tag = self.image, "latest"
        if "/" not in repo:
            raise ClusterError(f"the swarm has {nodes} nodes and the image {self.image} is only on this one: tag it "
                               "for a registry they share and pass --image REGISTRY/wiiide:TAG (pushed by the harness)")
        progress(f"    swarm: pushing {self.image} for the other {nodes - 1} nodes")
        for line in self.client.images.push(repo, tag=tag, stream=True, decode=True):
            if line.get("error"):
                raise ClusterError(f"docker push {self.image} failed: {line['error']}")
        self._image_pushed = True

    def _wait_running(self, num_workers: int) -> list[TaskContainer]:
        """Every task's container, once all 1 + `num_workers` run. Raises ClusterError (see `start`)."""
        deadline = time.monotonic() + RUNNING_WAIT_S
        while True:
            containers, problems = task_containers(self.engines, self.stack, ("coordinator", "worker"))
            if problems:
                raise ClusterError(f"stack {self.stack}: a task failed before it ran: {'; '.join(problems)}")
            started = [c for c in containers if c.status != "created"]
            if len(started) >= 1 + num_workers:
                return containers
            if time.monotonic() > deadline:
                raise ClusterError(f"stack {self.stack}: {len(started)} of {1 + num_workers} task containers "
                                   f"ran within {RUNNING_WAIT_S:.0f} s; see `docker stack ps {self.stack} --no-trunc`")
            time.sleep(0.25)

    def poll(self) -> dict[str, str]:
        """Each task container's state now (``running``, ``paused``, ``exited``...), by name: one Engine
        API list call for this node's tasks, one inspect per task on another node."""
        local = self.engines.local_node_id
        listed = {item["Id"]: item.get("State") for item in self.client.api.containers(
            all=True, filters={"label": f"{STACK_LABEL}={self.stack}"})}
        states = {}
        for c in self._containers:
            if c.node_id == local:
                states[c.name] = listed.get(c.id, "exited")  # a removed one has exited
                continue
            try:
                c.reload()
                states[c.name] = c.status
            except Exception:  # removed behind our back: it is not running
                states[c.name] = "exited"
        return states

    def stop(self) -> None:
        """Stop the stats readers, the counter sampler, and every task container still running. Idempotent."""
        if self._conditions is not None:
            self._conditions.stop()
        stop_readers(self._readers.values())
        for c in self._containers:
            try:
                c.reload()
                if c.status in ("running", "paused"):
                    if c.status == "paused":
                        set_container_paused(c, False)
                    c.stop(timeout=STOP_GRACE_S)
            except Exception:  # already gone
                pass

    def collect(self, logs_dir: Path, progress: Progress) -> Collected:
        """Exit codes (None: still running), each task's log into `logs_dir`, per-task stats with the
        node that ran it, links and limits. Node metrics of tasks on other hosts (or all, with
        `COPY_METRICS_ENV` = 1) are copied into ``logs_dir/../nodes`` through their engines."""
        exit_codes: dict[str, int | None] = {}
        for c in self._containers:
            try:
                c.reload()
                exit_codes[c.name] = c.attrs["State"]["ExitCode"] if c.status in ("exited", "dead") else None
                (Path(logs_dir) / f"{c.name}.log").write_bytes(c.logs(stdout=True, stderr=True))
            except Exception as exc:  # a container already gone: note it, keep going
                exit_codes.setdefault(c.name, None)
                progress(f"    could not read {c.name}: {exc}")
        copy_all = os.environ.get(COPY_METRICS_ENV) == "1" or self._hosts is not None  # hosts: mounts in the hosts
        for c in self._containers:
            if copy_all or c.node_id != self.engines.local_node_id:
                try:
                    copy_node_metrics(c, Path(logs_dir).parent / "nodes")
                    c.metrics_via = "archive copy"
                except ClusterError as exc:
                    progress(f"    {exc}")
        containers = {}
        for c in self._containers:
            samples = self._readers[c.name].samples if c.name in self._readers else []
            containers[c.name] = {"role": c.service, "kind": "container", "exit_code": exit_codes.get(c.name),
                                  **container_lifetime(c), "node": c.node, "node_id": c.node_id, "task_slot": c.slot,
                                  "container_id": c.id[:12], "metrics_via": c.metrics_via,
                                  "overlay_mtu_bytes": getattr(c, "overlay_mtu_bytes", None),
                                  "samples": samples, "summary": summarize_samples(samples)}
        conditions = self._conditions
        return Collected(exit_codes=exit_codes, containers=containers,
                         links=conditions.links if conditions else {}, limits=conditions.limits if conditions else {})

    def teardown(self) -> None:
        """Remove the run's stack: services, task containers, overlay network (and the iptables rules an
        encrypted one leaves: `remove_stack`), secret. Idempotent."""
        stop_readers(self._readers.values())
        if self._conditions is not None:
            self._conditions.stop()
        self._conditions = None
        if self._deployed:
            remove_stack(self.client, self.stack, self._progress)
            self._deployed = False
        self._containers, self._readers = [], {}

    def close(self, progress: Progress = print) -> None:
        """After the last run: tear down, then leave the swarm if the harness started it."""
        self.teardown()
        if self.started_swarm:
            leave_swarm_if_ours(self.client, progress)
            self.started_swarm, self._engines = False, None


def cluster_down(progress: Progress = print) -> None:
    """``down --backend swarm``: remove the project's stack (with its network and secret), then leave the
    swarm if the harness started it. Nothing there: nothing done.

    Raises:
        ClusterError: the stack could not be removed, or the swarm not left.
    """
    if os.environ.get(HOSTS_ENV) == "1":  # --hosts: the stack on the hosts' swarm (`hosts down` removes all)
        from harness.hosts.engines import attach
        client = docker_client(base_url=attach().manager_url)
    else:
        client = docker_client()
    remove_stack(client, stack_name(), progress)
    leave_swarm_if_ours(client, progress)
