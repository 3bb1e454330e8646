"""A stack's tasks: the engine of the node each runs on, its container presented as the shaping and
fault code knows Compose containers, its metrics copied out, its overlay interface checked."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

from harness.errors import ClusterError, LinkShapingError
from harness.run.docker_client import docker_client
from harness.run.shaping import NUMBER_LABEL, SERVICE_LABEL
from harness.run.swarm.cluster import swarm_info

ENDPOINTS_ENV = "WIIIIIDE_SWARM_ENDPOINTS"
COPY_METRICS_ENV = "WIIIIIDE_SWARM_COPY_METRICS"  # 1: copy every task's metrics through the Engine API, local ones too


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
    container (`harness.run.shaping.container_identity`, `harness.run.faults.ContainerController`):
    ``name`` ``<stack>_<service>_<slot>``, and ``labels`` with Compose's service and number labels.
    Everything else (``exec_run``, ``kill``, ``pause``, ``update``, ``stats``, ``attrs``...) is the
    docker SDK container's own. `node_id` / `node` are the swarm node that runs the task."""

    def __init__(self, container, stack: str, service: str, slot: int, node_id: str, node: str) -> None:
        self._container = container
        self.service, self.slot, self.node_id, self.node = service, slot, node_id, node
        self.name = f"{stack}_{service}_{slot}"
        self.metrics_via = "bind mount"  # or "archive copy" (`copy_node_metrics`), set by `SwarmBackend.collect`
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


def copy_node_metrics(container, nodes_dir: Path) -> list[str]:
    """Copy the node metrics files (``*.json``, ``coordinator.training``) a task wrote under
    ``/results/nodes`` out of its container through its node's Engine API (``GET /archive``; works on
    an exited container) into `nodes_dir`; return the names copied. What a task on another host wrote
    into its own host's bind mount reaches the run's folder this way.

    Raises:
        ClusterError: the archive cannot be read.
    """
    import io
    import tarfile
    try:
        stream, _ = container.get_archive("/results/nodes")
        data = io.BytesIO(b"".join(stream))
    except Exception as exc:  # docker.errors.NotFound / APIError
        raise ClusterError(f"{container.name}: cannot copy /results/nodes out: {exc}") from None
    nodes_dir.mkdir(parents=True, exist_ok=True)
    copied = []
    with tarfile.open(fileobj=data) as tar:
        for member in tar.getmembers():
            name = Path(member.name).name
            if not member.isfile() or not (name.endswith(".json") or name == "coordinator.training"):
                continue
            source = tar.extractfile(member)
            if source is not None:
                (nodes_dir / name).write_bytes(source.read())
                copied.append(name)
    return copied


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


def read_mtu(container, interface: str = "eth0") -> int | None:
    """The MTU of `interface` in a running task, bytes (``/sys/class/net/IF/mtu``; 1450 on an overlay
    over a 1500-byte underlay: VXLAN's 50 bytes). None when it cannot be read (the task already exited)."""
    try:
        code, out = container.exec_run(["cat", f"/sys/class/net/{interface}/mtu"])
        return int(out) if code == 0 else None
    except Exception:  # docker.errors.APIError (not running), ValueError
        return None
