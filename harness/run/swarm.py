"""The ``swarm`` backend: the same cluster as ``compose.yaml`` describes, as a Docker Swarm stack.

One run is one stack (`stack_name`), deployed with ``docker stack deploy`` from two files generated
into the run's folder (``<out_dir>/swarm/``), never kept by hand:

- ``stack-base.yaml``: compose.yaml as the stack loader accepts it (`stack_base`). The loader checks
  the v3 schema, which refuses compose.yaml's ``cpus`` / ``mem_limit`` (they become
  ``deploy.resources.limits``) and the long form of ``depends_on`` (dropped: a stack has no start
  order, workers retry connecting for ``connect_timeout_s``); ``restart`` and ``expose`` are dropped
  (``deploy.restart_policy`` replaces the first, an overlay needs no exposed port).
- ``stack-override.yaml``: what Swarm needs on top (`stack_override`): ``deploy.replicas`` of the
  workers, ``restart_policy: none`` (a finished or killed task is never replaced), ``endpoint_mode:
  dnsrr`` (the service name resolves to the task's own address, no IPVS virtual IP in the data path),
  the worker hostname ``worker-{{.Task.Slot}}`` (Swarm's template, moby#31218), and the project
  network as an *internal* overlay (VXLAN; internal: no ``docker_gwbridge`` leg, so ``eth0`` is the
  overlay in every task and the only interface tc shapes).

``deploy.mode: replicated-job`` (docker/cli#2907) was tried first: on Engine 20.10 its tasks got slot 0
and were named by node id, so ``{{.Task.Slot}}`` could not number the workers; ``replicated`` with
``restart_policy: none`` gives the same "a finished task stays finished" with slots 1..N.

Ranks come from the coordinator as on every backend; the coordinator is found by its service name
(``coordinator``) through Swarm's DNS. The HMAC secret is a Swarm secret the stack creates from a 0600
file (`harness.run.compose.write_cluster_secret`) and removes with the stack. Node metrics land in the
results folder through the same bind mount as Compose (on one node; see the README for several).

The swarm itself: `ensure_swarm` runs ``docker swarm init --advertise-addr 127.0.0.1`` when the engine
is in no swarm and labels the node `STARTED_LABEL` = project; `leave_swarm_if_ours` leaves it again
(and removes ``docker_gwbridge``) only when that label is there. A swarm that existed is used and left
as it was.

Several nodes: a task's container lives on the node that ran it, and only that node's engine can
exec tc in it, pause it or stream its stats. `NodeEngines` maps a node's hostname to an Engine API
endpoint (``WIIIIIDE_SWARM_ENDPOINTS="host-a=ssh://root@host-a,host-b=tcp://10.0.0.2:2376"``); the
local node needs none. Tried on one node only.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

import yaml

from harness import REPO_ROOT
from harness.errors import ClusterError, LinkShapingError
from harness.links.plan import Capabilities
from harness.run.backend import (
    Backend,
    Progress,
    RunResult,
    collect_nodes,
    default_timeout_s,
    judge,
)
from harness.run.compose import (
    DEFAULT_IMAGE,
    PROJECT,
    SERVICE_LABEL,
    _ContainerController,
    _StatsReader,
    compose_env,
    write_cluster_secret,
)
from harness.run.docker_client import docker_client
from harness.run.faults import FaultInjector
from harness.run.shaping import NUMBER_LABEL, START_GATE_FILE, ClusterConditions
from harness.run.stats import summarize_samples
from harness.run.tc_exec import probe_capabilities
from harness.spec.cluster import ClusterSettings
from wiiide.config import RunConfig

COMPOSE_FILE = REPO_ROOT / "compose.yaml"
STACK_LABEL = "com.docker.stack.namespace"  # put by `docker stack deploy` on services, networks, secrets, configs
SWARM_SERVICE_LABEL = "com.docker.swarm.service.name"
STARTED_LABEL = "io.wiiide.harness.swarm-started-by"  # node label: the harness ran `swarm init` for this project
ENDPOINTS_ENV = "WIIIIIDE_SWARM_ENDPOINTS"
ADVERTISE_ENV = "WIIIIIDE_SWARM_ADVERTISE_ADDR"
MAX_PER_NODE_ENV = "WIIIIIDE_SWARM_MAX_REPLICAS_PER_NODE"
SINGLE_NODE_ADDR = "127.0.0.1"  # a swarm the harness starts listens and advertises on loopback only
STACK_DROPPED_KEYS = {
    "depends_on": "a stack has no start order (workers retry connecting for connect_timeout_s)",
    "restart": "replaced by deploy.restart_policy (condition: none)",
    "expose": "an overlay network needs no exposed port",
    "cpus": "moved to deploy.resources.limits.cpus",
    "mem_limit": "moved to deploy.resources.limits.memory",
}
# Keys `docker stack deploy` ignores: a compose.yaml using them would not run as written, so refused.
STACK_IGNORED_KEYS = ("build", "container_name", "privileged", "devices", "network_mode", "links",
                      "external_links", "security_opt", "userns_mode", "cgroup_parent", "tmpfs")
RUNNING_WAIT_S = 120.0  # seconds after deploy for every task's container to run (image present: ~2 s)
TEARDOWN_WAIT_S = 60.0  # seconds for Swarm to remove a stack's task containers before its network goes
STOP_GRACE_S = 5


def stack_name(project: str = PROJECT) -> str:
    """The stack of a project's runs: ``<project>-stack`` (services ``<stack>_coordinator``, ``<stack>_worker``)."""
    return f"{project}-stack"


# --------------------------------------------------------------------------------------------- the swarm

def swarm_info(client) -> dict[str, Any]:
    """The engine's ``Swarm`` section of ``docker info``: ``LocalNodeState`` (inactive, active, pending,
    error, locked), ``NodeID``, ``ControlAvailable`` (a manager), ``Nodes``."""
    return client.info().get("Swarm") or {}


def ensure_swarm(client, progress: Progress, advertise_addr: str | None = None) -> bool:
    """Make sure this engine is a manager of a swarm; return True when the harness started it.

    An inactive engine gets ``docker swarm init --advertise-addr ADDR --listen-addr ADDR:2377``
    (`ADVERTISE_ENV`, default 127.0.0.1: a single-node swarm reachable from nowhere else) and its node
    the label `STARTED_LABEL` = project, so that `leave_swarm_if_ours` (``down``, the end of a sweep,
    or a later run after a crash) may leave it. An active swarm is used as it is and never labelled.

    Raises:
        ClusterError: the engine is a swarm worker (stacks deploy from a manager), locked, or in error,
            or ``swarm init`` failed.
    """
    info = swarm_info(client)
    state = info.get("LocalNodeState", "inactive")
    if state == "active":
        if not info.get("ControlAvailable"):
            raise ClusterError("this engine is a swarm worker, not a manager: run the harness on a manager node "
                               "(`docker node ls` there), or `docker node promote` this one")
        return False
    if state != "inactive":
        raise ClusterError(f"this engine's swarm state is {state!r} ({info.get('Error') or 'no error given'}); "
                           "unlock it or `docker swarm leave --force`, then run again")
    addr = advertise_addr or os.environ.get(ADVERTISE_ENV, SINGLE_NODE_ADDR)
    try:
        client.swarm.init(advertise_addr=addr, listen_addr=f"{addr}:2377")
        node = client.nodes.get(swarm_info(client)["NodeID"])
        spec = dict(node.attrs["Spec"])
        spec["Labels"] = {**(spec.get("Labels") or {}), STARTED_LABEL: PROJECT}
        node.update(spec)
    except Exception as exc:  # docker.errors.APIError
        raise ClusterError(f"`docker swarm init --advertise-addr {addr}` failed: {exc}") from None
    progress(f"    swarm: started a single-node swarm on {addr} (labelled {STARTED_LABEL}={PROJECT}; "
             "`down --backend swarm` or the end of the sweep leaves it)")
    return True


def started_by_harness(client) -> bool:
    """Whether this engine's swarm carries the label `ensure_swarm` puts on a swarm it started."""
    info = swarm_info(client)
    if info.get("LocalNodeState") != "active" or not info.get("ControlAvailable"):
        return False
    node = client.nodes.get(info["NodeID"])
    return (node.attrs.get("Spec", {}).get("Labels") or {}).get(STARTED_LABEL) == PROJECT


def leave_swarm_if_ours(client, progress: Progress) -> bool:
    """Leave the swarm when the harness started it for this project (`started_by_harness`) and no
    service of anyone else runs on it; then remove ``docker_gwbridge``, which ``swarm init`` made.
    Return whether it left. A swarm the harness did not start is left as it was, saying so.

    Raises:
        ClusterError: ``swarm leave`` failed.
    """
    if not started_by_harness(client):
        if swarm_info(client).get("LocalNodeState") == "active":
            progress("    swarm: not started by the harness for this project: left as it was")
        return False
    others = [s.name for s in client.services.list()]
    if others:
        progress(f"    swarm: kept (services still on it: {', '.join(sorted(others))})")
        return False
    try:
        client.swarm.leave(force=True)
    except Exception as exc:
        raise ClusterError(f"`docker swarm leave --force` failed: {exc}") from None
    for network in client.networks.list(names=["docker_gwbridge"]):
        try:
            network.remove()
        except Exception as exc:  # still in use by a container of someone else: say so, keep going
            progress(f"    swarm: docker_gwbridge kept: {exc}")
    progress("    swarm: left the swarm the harness had started")
    return True


# ------------------------------------------------------------------------------------- the stack files

def stack_base(compose: Mapping[str, Any]) -> dict[str, Any]:
    """compose.yaml (parsed, anchors resolved, variables NOT substituted) as the stack loader accepts it:
    without ``x-`` extension keys, each service's `STACK_DROPPED_KEYS` dropped or moved (``cpus`` ->
    ``deploy.resources.limits.cpus``, ``mem_limit`` -> ``...memory``). Pure.

    Raises:
        ClusterError: a service uses a key `docker stack deploy` ignores (`STACK_IGNORED_KEYS`): it would
            not run as compose.yaml says.
    """
    base = {k: v for k, v in compose.items() if not str(k).startswith("x-")}
    services = {}
    for name, svc in (compose.get("services") or {}).items():
        ignored = [k for k in STACK_IGNORED_KEYS if k in svc]
        if ignored:
            raise ClusterError(f"compose.yaml: services.{name}.{ignored[0]}: `docker stack deploy` ignores it, so "
                               "the swarm backend cannot run this service as written; drop it or use --backend docker")
        out = {k: v for k, v in svc.items() if k not in STACK_DROPPED_KEYS}
        limits = {key: svc[src] for src, key in (("cpus", "cpus"), ("mem_limit", "memory")) if src in svc}
        if limits:
            deploy = dict(out.get("deploy") or {})
            deploy["resources"] = {**(deploy.get("resources") or {}),
                                   "limits": {k: str(v) for k, v in limits.items()}}
            out["deploy"] = deploy
        services[name] = out
    base["services"] = services
    return base


def stack_override(num_workers: int, network: str, max_replicas_per_node: int | None = None) -> dict[str, Any]:
    """What Swarm needs on top of `stack_base` for one run of `num_workers` workers on the project
    network `network` (see the module docstring for why each key). Pure.

    `max_replicas_per_node`: ``deploy.placement.max_replicas_per_node`` of the workers (spreads them over
    the nodes of a multi-node swarm; None: no limit).
    """
    def deploy(replicas: int) -> dict[str, Any]:
        return {"mode": "replicated", "replicas": replicas, "endpoint_mode": "dnsrr",
                "restart_policy": {"condition": "none"}}

    worker = {"hostname": "worker-{{.Task.Slot}}", "deploy": deploy(num_workers)}
    if max_replicas_per_node:
        worker["deploy"]["placement"] = {"max_replicas_per_node": int(max_replicas_per_node)}
    return {"services": {"coordinator": {"deploy": deploy(1)}, "worker": worker},
            "networks": {network: {"driver": "overlay", "internal": True}}}


def write_stack_files(folder: Path, num_workers: int, compose_file: Path = COMPOSE_FILE) -> list[Path]:
    """Write ``stack-base.yaml`` and ``stack-override.yaml`` into `folder`; return both paths, in the
    order ``docker stack deploy -c`` takes them.

    Raises:
        ClusterError: compose.yaml cannot be read, has no single network, or uses an ignored key.
    """
    try:
        compose = yaml.safe_load(compose_file.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ClusterError(f"{compose_file}: cannot read: {exc}") from None
    networks = list(compose.get("networks") or {})
    if len(networks) != 1:
        raise ClusterError(f"{compose_file}: networks: the swarm backend runs one overlay network; found {networks}")
    max_per_node = os.environ.get(MAX_PER_NODE_ENV)
    folder.mkdir(parents=True, exist_ok=True)
    paths = [folder / "stack-base.yaml", folder / "stack-override.yaml"]
    header = f"# generated by harness.run.swarm from {compose_file.name}; not kept by hand\n"
    for path, data in zip(paths, (stack_base(compose),
                                  stack_override(num_workers, networks[0], int(max_per_node) if max_per_node else None))):
        path.write_text(header + yaml.safe_dump(data, sort_keys=False))
    return paths


def stack_env(cfg: RunConfig, results_dir: Path, image: str, extra_env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment ``docker stack deploy`` interpolates compose.yaml's ``${WIIIIIDE_*}`` from: the
    same as Compose's (`harness.run.compose.compose_env`) plus `extra_env` (role-wide limits)."""
    return {**compose_env(cfg, results_dir, image), **(extra_env or {})}


def deploy_stack(files: Sequence[Path], stack: str, env: Mapping[str, str]) -> str:
    """``docker stack deploy --resolve-image never -c F1 -c F2 STACK``; return its output.

    ``--resolve-image never``: tasks use the tag as the nodes have it (no registry is asked; with
    several nodes, push the image to a registry they share and name it with WIIIIIDE_IMAGE=REPO:TAG).

    Raises:
        ClusterError: the CLI is missing or the deploy failed (with the command and its message).
    """
    cmd = ["docker", "stack", "deploy", "--resolve-image", "never"]
    for path in files:
        cmd += ["-c", str(path)]
    cmd.append(stack)
    try:
        out = subprocess.run(cmd, env=dict(env), capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ClusterError(f"`{' '.join(cmd)}` could not run: {exc}") from None
    if out.returncode != 0:
        tail = "\n".join((out.stderr or out.stdout).strip().splitlines()[-15:])
        raise ClusterError(f"`{' '.join(cmd)}` failed (exit {out.returncode}):\n{tail}")
    return out.stdout + out.stderr


def stack_objects(client, stack: str) -> dict[str, list]:
    """Everything of `stack` still there: ``services``, ``containers`` (its tasks', on this node),
    ``networks``, ``secrets``, ``configs`` (docker SDK objects, found by `STACK_LABEL`)."""
    label = {"label": f"{STACK_LABEL}={stack}"}
    return {"services": client.services.list(filters=label),
            "containers": client.containers.list(all=True, filters=label),
            "networks": client.networks.list(filters=label),
            "secrets": client.secrets.list(filters=label),
            "configs": client.configs.list(filters=label)}


def remove_stack(client, stack: str, progress: Progress, wait_s: float = TEARDOWN_WAIT_S) -> None:
    """Remove `stack` as ``docker stack rm`` does, and wait until it is gone: its services (Swarm then
    removes their task containers), then, once no task container is left, its networks, secrets and
    configs. A no-op for a stack that is not there.

    Raises:
        ClusterError: something of the stack is still there after `wait_s` seconds (naming it).
    """
    if swarm_info(client).get("LocalNodeState") != "active":
        return
    for service in stack_objects(client, stack)["services"]:
        try:
            service.remove()
        except Exception as exc:  # docker.errors.NotFound: gone meanwhile
            if type(exc).__name__ != "NotFound":
                progress(f"    swarm: removing service {service.name}: {exc}")
    deadline = time.monotonic() + wait_s
    while True:
        left = stack_objects(client, stack)
        if not left["containers"] and not left["services"]:
            for kind in ("networks", "secrets", "configs"):
                for obj in left[kind]:
                    try:
                        obj.remove()
                    except Exception as exc:  # the network's endpoints are still being released: retry
                        if type(exc).__name__ != "NotFound" and time.monotonic() > deadline:
                            progress(f"    swarm: removing {kind[:-1]} {obj.name}: {exc}")
            left = stack_objects(client, stack)
            if not any(left.values()):
                return
        if time.monotonic() > deadline:
            names = {k: [getattr(o, "name", o.id) for o in v] for k, v in left.items() if v}
            raise ClusterError(f"stack {stack} still has {names} after {wait_s:.0f} s; "
                               f"`docker stack rm {stack}` and check `docker service ls`")
        time.sleep(0.5)


# ------------------------------------------------------------------------------------------ the tasks

class NodeEngines:
    """The Engine API endpoint of each swarm node: the local engine for this node, and for the others
    the endpoints in `ENDPOINTS_ENV` (``HOSTNAME=URL`` pairs, comma-separated; URL as docker's
    ``DOCKER_HOST``: ``ssh://user@host``, ``tcp://host:2376``). A task's container can only be reached
    through the engine of the node that runs it (exec of tc, pause, kill, stats, logs)."""

    def __init__(self, client, endpoints: str | None = None) -> None:
        self.local = client
        self.local_node_id = swarm_info(client).get("NodeID")
        self.endpoints = parse_endpoints(os.environ.get(ENDPOINTS_ENV, "") if endpoints is None else endpoints)
        self._clients: dict[str, Any] = {}
        self._hostnames: dict[str, str] = {}

    def hostname(self, node_id: str) -> str:
        """The hostname of swarm node `node_id` (``docker node inspect``), cached."""
        if node_id not in self._hostnames:
            node = self.local.nodes.get(node_id)
            self._hostnames[node_id] = node.attrs.get("Description", {}).get("Hostname", node_id)
        return self._hostnames[node_id]

    def client_for(self, node_id: str):
        """A docker client of the engine on node `node_id`.

        Raises:
            ClusterError: the node is another host and `ENDPOINTS_ENV` names no endpoint for it.
        """
        if node_id == self.local_node_id:
            return self.local
        host = self.hostname(node_id)
        if host not in self.endpoints:
            raise ClusterError(f"a task runs on swarm node {host}, whose containers only its own engine reaches; "
                               f"set {ENDPOINTS_ENV}={host}=ssh://USER@{host} (or tcp://...) for it")
        if host not in self._clients:
            self._clients[host] = docker_client(base_url=self.endpoints[host])
        return self._clients[host]


def parse_endpoints(text: str) -> dict[str, str]:
    """``"a=ssh://root@a, b=tcp://10.0.0.2:2376"`` -> ``{"a": "ssh://root@a", "b": "tcp://10.0.0.2:2376"}``.

    Raises:
        ClusterError: an item is not ``HOSTNAME=URL``.
    """
    endpoints = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        host, sep, url = item.partition("=")
        if not sep or not host.strip() or "://" not in url:
            raise ClusterError(f"{ENDPOINTS_ENV}: {item!r}: expected HOSTNAME=URL (ssh://user@host or tcp://host:port)")
        endpoints[host.strip()] = url.strip()
    return endpoints


class TaskContainer:
    """One task's container, presented as the link-shaping, limits and fault code knows a Compose
    container (`harness.run.shaping.container_identity`, `harness.run.compose._ContainerController`):
    ``name`` ``<stack>_<service>_<slot>``, and ``labels`` with Compose's service and number labels.
    Everything else (``exec_run``, ``kill``, ``pause``, ``update``, ``stats``, ``attrs``...) is the
    docker SDK container's own. `node_id` / `node` are the swarm node that runs the task."""

    def __init__(self, container, stack: str, service: str, slot: int, node_id: str, node: str) -> None:
        self._container = container
        self.service, self.slot, self.node_id, self.node = service, slot, node_id, node
        self.name = f"{stack}_{service}_{slot}"
        self.labels = {**(container.labels or {}), SERVICE_LABEL: service, NUMBER_LABEL: str(slot)}

    def __getattr__(self, attr: str):
        return getattr(self._container, attr)


def task_containers(engines: NodeEngines, stack: str, services: Sequence[str]) -> tuple[list[TaskContainer], list[str]]:
    """The containers of every task of `services` of `stack` that has one, and one line per task that
    failed before its container ran (``"worker slot 2: no suitable node ..."``).

    Raises:
        ClusterError: a service is missing, or a task's node has no reachable engine (`NodeEngines`).
    """
    client = engines.local
    found, problems = [], []
    for service in services:
        try:
            tasks = client.services.get(f"{stack}_{service}").tasks()
        except Exception as exc:
            raise ClusterError(f"service {stack}_{service} is not there: {exc}") from None
        for task in tasks:
            status = task.get("Status") or {}
            slot = int(task.get("Slot") or 0)
            if status.get("State") in ("rejected", "failed") and not (status.get("ContainerStatus") or {}).get("ContainerID"):
                problems.append(f"{service} slot {slot}: {status.get('Err') or status.get('State')}")
                continue
            container_id = (status.get("ContainerStatus") or {}).get("ContainerID")
            if not container_id:
                continue
            node_id = task.get("NodeID", "")
            try:
                container = engines.client_for(node_id).containers.get(container_id)
            except ClusterError:
                raise
            except Exception:  # not created yet on that node: the next look finds it
                continue
            found.append(TaskContainer(container, stack, service, slot, node_id, engines.hostname(node_id)))
    found.sort(key=lambda c: (c.service != "coordinator", c.slot))
    return found, problems


class _SwarmController(_ContainerController):
    """Fault actions on the tasks' containers (kill, pause, disconnect): those of Compose's, through the
    engine of the task's node. ``restart`` is refused by `SwarmBackend.check_faults`."""


class SwarmBackend(Backend):
    """The ``swarm`` backend: one stack per run on a (single-node unless joined) Docker Swarm.

    start / poll / stop / collect / teardown are the steps of one run (the shape of the run stage's
    Backend protocol); `run` drives them; `close` leaves a swarm the harness started.
    """

    name = "swarm"

    def __init__(self, image_tag: str | None = None, progress: Progress = print) -> None:
        """Raises ClusterError when no Docker engine answers. The swarm is joined or started later, by
        `describe` or the first `start` (so a spec refused by the checks leaves the engine untouched)."""
        self.image = image_tag or os.environ.get("WIIIIIDE_IMAGE", DEFAULT_IMAGE)
        self.client = docker_client()
        self.stack = stack_name()
        self.started_swarm = False
        self._progress = progress
        self._engines: NodeEngines | None = None
        self._containers: list[TaskContainer] = []
        self._readers: dict[str, _StatsReader] = {}
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
            self._engines = NodeEngines(self.client)
        return self._engines

    def prepare(self, progress: Progress) -> None:
        """(Re)build the image on this node (the others need it from a registry: see the README).

        Raises:
            ClusterError: the image cannot be built.
        """
        from harness.run.image import build_image
        build_image(self.image, log=lambda line: progress(f"    image: {line}"))

    def describe(self) -> dict[str, Any]:
        """Engine version, the swarm (nodes, whether the harness started it), the stack, the image.
        Joins or starts the swarm first (`engines`); raises ClusterError when it cannot."""
        self.engines
        version = self.client.version()
        info = swarm_info(self.client)
        return {"name": self.name, "engine_version": version.get("Version"), "api_version": version.get("ApiVersion"),
                "image": self.image, "project": PROJECT, "stack": self.stack,
                "swarm_nodes": info.get("Nodes"), "swarm_managers": info.get("Managers"),
                "swarm_started_by_harness": self.started_swarm, "network": "overlay (VXLAN), internal",
                "storage_driver": self.client.info().get("Driver")}

    def check_cluster(self, cluster: ClusterSettings | None) -> None:
        """Links, CPU and memory limits are applied in each task's container (as on ``docker``): never raises."""

    def check_faults(self, faults) -> None:
        """``restart`` is refused (ClusterError): Swarm does not restart a task's container, it replaces
        the task, and with ``restart_policy: none`` a killed task stays down. kill, pause and disconnect work."""
        if any(f.action == "restart" for f in faults or ()):
            raise ClusterError("the swarm backend cannot restart a killed node: Swarm replaces tasks rather than "
                               "restarting their containers, and the stack's restart_policy is none; "
                               "use --backend docker for `restart` faults")

    def _probe(self) -> Capabilities:
        return probe_capabilities(self.client, self.image, {STACK_LABEL: self.stack})

    # ---- the steps of one run
    def start(self, cfg: RunConfig, out_dir: Path, cluster: ClusterSettings, progress: Progress,
              t0: float | None = None) -> _SwarmController:
        """Deploy the run's stack, wait until every task's container runs, then set limits, shape links
        and open the start gate. Return the fault controller.

        Raises:
            ClusterError: the stack could not be deployed, a task failed or did not run within
                `RUNNING_WAIT_S` seconds, a limit could not be set.
            LinkShapingError: a link profile cannot be applied (before anything is deployed when the
                kernel lacks a qdisc), or eth0 of a task is not its overlay interface.
        """
        t0 = time.monotonic() if t0 is None else t0
        out_dir = Path(out_dir).resolve()
        (out_dir / "nodes").mkdir(parents=True, exist_ok=True)
        self._conditions = conditions = ClusterConditions(cluster or ClusterSettings(), self._probe)
        self.engines  # the swarm: joined, or started on this node
        remove_stack(self.client, self.stack, progress)  # a clean slate: nothing left from a killed run
        conditions.plan(cfg.num_workers)
        if conditions.gated:
            cfg = cfg.replace(start_gate_file=START_GATE_FILE)
        self._share_image(progress)
        files = write_stack_files(out_dir / "swarm", cfg.num_workers)
        write_cluster_secret()
        self._deployed = True
        deploy_stack(files, self.stack, stack_env(cfg, out_dir, self.image, conditions.settings.compose_env()))
        self._containers = self._wait_running(cfg.num_workers)
        for c in self._containers:
            self._readers[c.name] = _StatsReader(c, t0)
        if conditions.gated:
            if conditions.settings.link is not None:
                for c in self._containers:
                    check_overlay_eth0(c, self.stack)
            conditions.apply(self._containers, t0, progress)
        return _SwarmController(self._containers)

    def _share_image(self, progress: Progress) -> None:
        """On a swarm of several nodes, push the image once to the registry its name points at (the
        other nodes pull it from there); on one node nothing is needed.

        Raises:
            ClusterError: several nodes and an image name with no registry (``wiiide:latest``), or the push failed.
        """
        nodes = swarm_info(self.client).get("Nodes") or 1
        if nodes <= 1 or self._image_pushed:
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
        """Each task container's state now (``running``, ``paused``, ``exited``...), by name."""
        states = {}
        for c in self._containers:
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
        for reader in self._readers.values():
            reader.stop()
        for c in self._containers:
            try:
                c.reload()
                if c.status in ("running", "paused"):
                    if c.status == "paused":
                        c.unpause()
                    c.stop(timeout=STOP_GRACE_S)
            except Exception:  # already gone
                pass

    def collect(self, logs_dir: Path, progress: Progress) -> dict[str, Any]:
        """Exit codes, logs (written to `logs_dir`), per-task stats with the node that ran each task,
        links and limits: ``{"exit_codes", "containers", "links", "limits"}``."""
        exit_codes: dict[str, int | None] = {}
        for c in self._containers:
            try:
                c.reload()
                exit_codes[c.name] = c.attrs["State"]["ExitCode"] if c.status in ("exited", "dead") else None
                (Path(logs_dir) / f"{c.name}.log").write_bytes(c.logs(stdout=True, stderr=True))
            except Exception as exc:  # a container already gone: note it, keep going
                exit_codes.setdefault(c.name, None)
                progress(f"    could not read {c.name}: {exc}")
        containers = {}
        for c in self._containers:
            samples = self._readers[c.name].samples if c.name in self._readers else []
            containers[c.name] = {"role": c.service, "kind": "container", "exit_code": exit_codes.get(c.name),
                                  "node": c.node, "node_id": c.node_id, "task_slot": c.slot,
                                  "container_id": c.id[:12], "samples": samples, "summary": summarize_samples(samples)}
        conditions = self._conditions
        return {"exit_codes": exit_codes, "containers": containers,
                "links": conditions.links if conditions else {}, "limits": conditions.limits if conditions else {}}

    def teardown(self) -> None:
        """Remove the run's stack: services, task containers, overlay network, secret. Idempotent."""
        if self._deployed:
            remove_stack(self.client, self.stack, lambda line: None)
            self._deployed = False
        self._containers, self._readers = [], {}

    def close(self, progress: Progress = print) -> None:
        """After the last run: tear down, then leave the swarm if the harness started it."""
        self.teardown()
        if self.started_swarm:
            leave_swarm_if_ours(self.client, progress)
            self.started_swarm, self._engines = False, None

    # ---- one whole run (the sweep's entry point until the run stage's shared loop drives start/poll/...)
    def run(self, cfg: RunConfig, out_dir: Path, timeout_s: float | None, progress: Progress,
            cluster: ClusterSettings | None = None, faults=()) -> RunResult:
        """Run one cluster with `cfg` to its end as a stack; node metrics and logs under `out_dir`."""
        self.check_faults(faults)
        out_dir = Path(out_dir).resolve()
        logs_dir = out_dir / "logs"
        logs_dir.mkdir(parents=True, exist_ok=True)
        timeout_s = timeout_s or default_timeout_s(cfg)
        t0 = time.monotonic()
        status, error = "ok", None
        injector = None
        collected: dict[str, Any] = {"exit_codes": {}, "containers": {}, "links": {}, "limits": {}}
        try:
            controller = self.start(cfg, out_dir, cluster or ClusterSettings(), progress, t0)
            injector = FaultInjector(list(faults), controller, out_dir / "nodes",
                                     wait_s=cfg.connect_timeout_s + 60).start()
            next_note = t0 + 10
            while True:
                states = self.poll()
                if all(s in ("exited", "dead") for s in states.values()):
                    break
                now = time.monotonic()
                if now - t0 > timeout_s:
                    status, error = "failed", f"timed out after {timeout_s:.0f} s; tasks still running were stopped"
                    break
                if now >= next_note:
                    running = sum(s == "running" for s in states.values())
                    progress(f"    running: {now - t0:.0f} s of about {cfg.duration_s:.0f} s, {running} tasks up")
                    next_note = now + 10
                time.sleep(0.25)
        except (ClusterError, LinkShapingError) as exc:
            status, error = "failed", str(exc)
        finally:
            if injector is not None:
                injector.stop()
            try:
                self.stop()
                collected = self.collect(logs_dir, progress)
            finally:
                self.teardown()
        nodes = collect_nodes(out_dir / "nodes")
        judged_status, judged_error = judge(nodes, collected["exit_codes"], cfg.num_workers,
                                            expected_dead=injector.affected if injector else frozenset(),
                                            expected_node_ids=injector.affected_node_ids if injector else frozenset())
        if status == "ok":
            status, error = judged_status, judged_error
        elif judged_error:
            error = f"{error}; {judged_error}"
        return RunResult(status, error, time.monotonic() - t0, nodes, collected["containers"], collected["exit_codes"],
                         str(logs_dir), links=collected["links"], limits=collected["limits"],
                         faults=injector.events if injector else [])


def check_overlay_eth0(container: TaskContainer, stack: str) -> None:
    """Make sure ``eth0`` in the task is its interface on the stack's overlay (the one tc shapes and
    `disconnect` cuts), by the address the Engine API gives for that network.

    Raises:
        LinkShapingError: the address is on another interface, or the task has no address on the overlay.
    """
    networks = container.attrs.get("NetworkSettings", {}).get("Networks") or {}
    address = next((n.get("IPAddress") for name, n in networks.items() if name.startswith(f"{stack}_")), None)
    if not address:
        raise LinkShapingError(f"{container.name}: no address on the stack's overlay ({sorted(networks)})")
    code, out = container.exec_run(["ip", "-o", "-4", "addr", "show", "dev", "eth0"])
    text = out.decode(errors="replace") if isinstance(out, bytes) else str(out)
    if code != 0 or f" {address}/" not in text:
        raise LinkShapingError(f"{container.name}: eth0 does not carry the overlay address {address} "
                               f"(`ip addr show dev eth0`: {text.strip()[:200]}); tc would shape the wrong link")


def cluster_up(cfg: RunConfig, results_dir: Path, image: str | None = None, progress: Progress = print) -> list[TaskContainer]:
    """``up --backend swarm``: deploy a stack that trains for ``cfg.duration_s`` and leave it running;
    return its task containers. ``down --backend swarm`` removes it.

    Raises:
        ClusterError: see `SwarmBackend.start`.
    """
    backend = SwarmBackend(image, progress)
    backend.start(cfg, results_dir, ClusterSettings(), progress)
    for reader in backend._readers.values():
        reader.stop()
    return backend._containers


def cluster_down(progress: Progress = print) -> None:
    """``down --backend swarm``: remove the project's stack (with its network and secret), then leave the
    swarm if the harness started it. Nothing there: nothing done.

    Raises:
        ClusterError: the stack could not be removed, or the swarm not left.
    """
    client = docker_client()
    remove_stack(client, stack_name(), progress)
    leave_swarm_if_ours(client, progress)
