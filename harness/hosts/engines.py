"""``hosts up`` / ``hosts down`` on the outer engine (docker SDK), the swarm between the hosts, the
node image through the registry, and `attach`: the engines of the hosts that run, for the swarm backend.

Every object made carries the label `harness.hosts.plan.LABEL` = project, and ``down`` removes by that
label, so it needs no state file and works after any failure (a failed ``up`` calls it itself).
"""

from __future__ import annotations

import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from harness.errors import ClusterError
from harness.hosts.plan import INDEX_LABEL, LABEL, ROLE_LABEL, REGISTRY_PORT, HostSpec, HostsPlan, split_tag
from harness.run.backend import Progress
from harness.run.compose_project import PROJECT
from harness.run.docker_client import docker_client

DOCKERD_WAIT_S = 60.0  # seconds for a host's dockerd to answer (about 2 s here)
REGISTRY_WAIT_S = 30.0
PULL_TIMEOUT_S = 900


@dataclass
class Hosts:
    """The hosts that run (`attach`): the plan they were made from, each host's Engine API URL by
    hostname (manager first), the registry as the hosts reach it and as this machine pushes to it."""

    plan: HostsPlan
    urls: dict[str, str]
    registry_address: str
    push_address: str
    containers: list[Any] = field(default_factory=list)  # the host containers (docker SDK, outer engine)

    @property
    def manager_url(self) -> str:
        return next(iter(self.urls.values()))

    def endpoints(self) -> str:
        """``WIIIIIDE_SWARM_ENDPOINTS``'s form: ``host-1=unix:///...,host-2=...``."""
        return ",".join(f"{name}={url}" for name, url in self.urls.items())


def _objects(client, project: str) -> dict[str, list]:
    label = {"label": f"{LABEL}={project}"}
    return {"containers": client.containers.list(all=True, filters=label),
            "volumes": client.volumes.list(filters=label),
            "networks": client.networks.list(filters=label)}


def leftovers(project: str = PROJECT, client=None) -> dict[str, list[str]]:
    """The names of every container, volume and network of `project`'s hosts still on the outer engine."""
    client = client or docker_client()
    return {kind: [o.name for o in objs] for kind, objs in _objects(client, project).items() if objs}


REMOVE_TIMEOUT_S = 600  # one Engine API call of `hosts down` (a container or volume removed), seconds


def hosts_down(progress: Progress, project: str = PROJECT) -> None:
    """Remove every host container (with its dockerd, tasks and swarm state), the registry, their volumes,
    the hosts' network and the socket folders. Nothing there: nothing done. Idempotent.

    Raises:
        ClusterError: something of them is still there afterwards (named).
    """
    import docker.errors

    # a host's volume holds its engine's /var/lib/docker (the node image pulled into overlay2, 1.3 GB):
    # removing it took over a minute on a loaded machine, past the SDK's default timeout
    client = docker_client(timeout_s=REMOVE_TIMEOUT_S)
    objs = _objects(client, project)
    for container in objs["containers"]:
        try:
            container.remove(force=True, v=True)
        except docker.errors.NotFound:
            pass
    for kind in ("volumes", "networks"):
        for obj in _objects(client, project)[kind]:
            try:
                obj.remove()
            except docker.errors.NotFound:
                pass
    socket_root = HostsPlan(project, 1).socket_root
    shutil.rmtree(socket_root / project, ignore_errors=True)
    try:
        socket_root.rmdir()  # only when no other project's hosts have sockets there
    except OSError:
        pass
    left = leftovers(project, client)
    if left:
        raise ClusterError(f"hosts down: still on the engine: {left}")
    if any(objs.values()):
        progress(f"[hosts] removed {len(objs['containers'])} containers, {len(objs['volumes'])} volumes, "
                 f"{len(objs['networks'])} network(s) of {project}'s hosts (their swarm state went with them)")


def _run_host(client, plan: HostsPlan, host: HostSpec, image: str):
    """Create and start `host`'s container through the low-level API (its host config needs keys the
    SDK's ``containers.run`` has no argument for); return it as a docker SDK container."""
    create, host_args = plan.host_container(host, image)
    raw = host_args.pop("raw")
    host_config = client.api.create_host_config(**host_args)
    host_config.update(raw)
    created = client.api.create_container(host_config=host_config, **create)
    client.api.start(created["Id"])
    return client.containers.get(created["Id"])


def _wait_dockerd(host: HostSpec, container, deadline: float):
    """A docker client of `host`'s dockerd once it answers. Raises ClusterError with its log otherwise."""
    while True:
        try:
            return docker_client(timeout_s=PULL_TIMEOUT_S, base_url=host.docker_url)
        except ClusterError:
            container.reload()
            if container.status != "running" or time.monotonic() > deadline:
                log = container.logs(tail=15).decode(errors="replace")
                raise ClusterError(f"{host.name}: its dockerd did not answer within {DOCKERD_WAIT_S:.0f} s "
                                   f"(container {container.status}); its log ends:\n{log}") from None
            time.sleep(0.5)


def _ip_on(container, network: str) -> str:
    container.reload()
    return container.attrs["NetworkSettings"]["Networks"][network]["IPAddress"]


def _form_swarm(plan: HostsPlan, clients: list, containers: list, progress: Progress) -> None:
    """``swarm init`` on host 1 at its address on the hosts' network, ``swarm join`` of the others with
    the worker join token, as on real hosts (2377/tcp, 7946, 4789/udp between them)."""
    manager_ip = _ip_on(containers[0], plan.network)
    try:
        clients[0].swarm.init(advertise_addr=manager_ip, listen_addr=f"{manager_ip}:2377")
        token = clients[0].swarm.attrs["JoinTokens"]["Worker"]
        for client, container in zip(clients[1:], containers[1:]):
            ip = _ip_on(container, plan.network)
            client.swarm.join(remote_addrs=[f"{manager_ip}:2377"], join_token=token,
                              advertise_addr=ip, listen_addr=f"{ip}:2377")
    except Exception as exc:  # docker.errors.APIError
        raise ClusterError(f"forming the swarm of the hosts failed: {exc}") from None
    progress(f"[hosts] swarm: manager {plan.hosts[0].name} at {manager_ip}:2377, {plan.count - 1} worker(s) joined")


def _push_address(client, plan: HostsPlan) -> str:
    """``127.0.0.1:PORT``: where this machine's engine reaches the registry (its published port)."""
    registry = client.containers.get(plan.registry)
    deadline = time.monotonic() + REGISTRY_WAIT_S
    while True:
        registry.reload()
        bound = (registry.attrs["NetworkSettings"]["Ports"] or {}).get(f"{REGISTRY_PORT}/tcp") or []
        if bound:
            return f"127.0.0.1:{bound[0]['HostPort']}"
        if time.monotonic() > deadline or registry.status != "running":
            raise ClusterError(f"the registry {plan.registry} has no published port ({registry.status}): "
                               + registry.logs(tail=10).decode(errors="replace"))
        time.sleep(0.25)


def distribute_image(hosts: Hosts, image: str, progress: Progress) -> str:
    """Push the node image `image` (on this machine's engine) to the hosts' registry and pull it on every
    host, as hosts in production pull; return its name there (``<registry>:5000/repo:tag``). The push
    goes through a temporary tag ``127.0.0.1:PORT/repo:tag`` on this engine, removed afterwards.
    Layers the registry or a host already has are not sent again.

    Raises:
        ClusterError: the image is not on this engine, or the push or a pull failed.
    """
    import docker.errors

    client = docker_client(timeout_s=PULL_TIMEOUT_S)
    local_ref = hosts.plan.image_in_registry(image, hosts.push_address)
    repo, tag = split_tag(local_ref)
    t0 = time.monotonic()
    try:
        client.images.get(image).tag(repo, tag)
        for line in client.images.push(repo, tag=tag, stream=True, decode=True):
            if line.get("error"):
                raise ClusterError(f"docker push {local_ref} failed: {line['error']}")
    except docker.errors.DockerException as exc:
        raise ClusterError(f"pushing {image} to the hosts' registry failed: {exc}") from None
    finally:
        try:
            client.images.remove(local_ref)
        except docker.errors.DockerException:
            pass
    ref = hosts.plan.image_in_registry(image, hosts.registry_address)
    t_push = time.monotonic() - t0

    def pull(url: str) -> None:
        host_client = docker_client(timeout_s=PULL_TIMEOUT_S, base_url=url)
        repo, tag = split_tag(ref)
        try:
            host_client.images.pull(repo, tag=tag)
        except docker.errors.DockerException as exc:
            raise ClusterError(f"pulling {ref} on {url} failed: {exc}") from None
        finally:
            host_client.close()

    with ThreadPoolExecutor(max_workers=len(hosts.urls)) as pool:
        list(pool.map(pull, hosts.urls.values()))
    progress(f"[hosts] {image} -> {ref}: pushed in {t_push:.1f} s, pulled on {len(hosts.urls)} hosts in "
             f"{time.monotonic() - t0 - t_push:.1f} s")
    return ref


def hosts_up(count: int, progress: Progress, project: str = PROJECT, node_image: str | None = None) -> Hosts:
    """Start `count` hosts (see the module docstring): remove what an earlier run of `project` left,
    build the host image if missing, create the network, the registry and each host, wait for every
    dockerd, form the swarm, then push `node_image` (if given) and pull it on every host. On any
    failure (and Ctrl-C) everything made so far is removed before the error propagates.

    Raises:
        ClusterError: a step failed (what, and the host's log where it applies).
    """
    from harness.hosts.image import ensure_host_image

    plan = HostsPlan(project, count)
    hosts_down(progress, project)
    image = ensure_host_image(log=progress)
    client = docker_client()
    t0 = time.monotonic()
    try:
        client.networks.create(plan.network, driver="bridge", labels=plan.labels("network"))
        client.volumes.create(plan.registry_volume, labels=plan.labels("registry"))
        client.containers.run(**plan.registry_container(image))
        containers = []
        for host in plan.hosts:
            host.socket_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            client.volumes.create(host.volume, labels=plan.labels("host", host.index))
            containers.append(_run_host(client, plan, host, image))
        deadline = time.monotonic() + DOCKERD_WAIT_S
        clients = [_wait_dockerd(host, c, deadline) for host, c in zip(plan.hosts, containers)]
        _form_swarm(plan, clients, containers, progress)
        hosts = Hosts(plan, {h.name: h.docker_url for h in plan.hosts}, plan.registry_address,
                      _push_address(client, plan), containers)
        progress(f"[hosts] {count} hosts up in {time.monotonic() - t0:.1f} s on network {plan.network}; "
                 f"registry {plan.registry_address} (pushed to at {hosts.push_address})")
        if node_image:
            distribute_image(hosts, node_image, progress)
        return hosts
    except BaseException as exc:
        progress(f"[hosts] up failed ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__}): "
                 "removing what it made")
        hosts_down(progress, project)
        if isinstance(exc, Exception) and not isinstance(exc, ClusterError):
            raise ClusterError(f"hosts up failed: {exc}") from exc
        raise


def encryption_note() -> str:
    """One line on whether an encrypted overlay (``overlay_encrypted: true``) could encrypt between the
    hosts: the kernel's ESP and GCM options (`harness.bench.overlay.kernel_ipsec`). All hosts share this
    kernel, so what it lacks, every host lacks."""
    from harness.bench.overlay import kernel_ipsec
    config = kernel_ipsec()["config"]
    if config is None:
        return "encrypted overlay: unknown (no /proc/config.gz to read CONFIG_INET_ESP from)"
    missing = [k for k in ("CONFIG_INET_ESP", "CONFIG_CRYPTO_GCM") if config.get(k) not in ("y", "m")]
    if missing:
        return (f"encrypted overlay: this kernel lacks {' and '.join(missing)}: overlay_encrypted: true would "
                "not encrypt the VXLAN traffic between these hosts (IPsec ESP, AES-GCM)")
    return "encrypted overlay: this kernel has ESP and GCM: overlay_encrypted: true encrypts between the hosts"


def attach(project: str = PROJECT, client=None) -> Hosts:
    """The hosts of `project` that run now, found by their labels on the outer engine.

    Raises:
        ClusterError: none runs (`wiiide-lab hosts up --hosts N` first), or one is not running.
    """
    client = client or docker_client()
    found = client.containers.list(all=True, filters={"label": [f"{LABEL}={project}", f"{ROLE_LABEL}=host"]})
    if not found:
        raise ClusterError(f"no hosts of {project} are up: start them with `wiiide-lab hosts up --hosts N` "
                           "(make hosts-up HOSTS=N)")
    found.sort(key=lambda c: int(c.labels.get(INDEX_LABEL, "0")))
    stopped = [c.name for c in found if c.status != "running"]
    if stopped:
        raise ClusterError(f"hosts {stopped} are not running: `wiiide-lab hosts down`, then up again")
    plan = HostsPlan(project, len(found))
    return Hosts(plan, {h.name: h.docker_url for h in plan.hosts}, plan.registry_address,
                 _push_address(client, plan), found)


def prepare_path(hosts: Hosts, path: str) -> None:
    """Create folder `path` in every host (where a task's bind mount of the run's folder points).

    Raises:
        ClusterError: mkdir failed in a host.
    """
    for container in hosts.containers:
        code, out = container.exec_run(["mkdir", "-p", path])
        if code != 0:
            raise ClusterError(f"{container.name}: mkdir -p {path}: {out.decode(errors='replace').strip()}")
