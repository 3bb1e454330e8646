"""The Compose project on one engine: its name, the environment compose.yaml is read with, the shared
secret and TLS files, and `cluster_up` / `cluster_down` through the Engine API.

The services of compose.yaml are created through the Docker Engine API (`harness.run.compose_file`:
the network, the coordinator, then the workers in parallel), with Compose's own labels and names, so
no Compose binary is needed and ``docker-compose -p PROJECT ps`` still sees the cluster. Every
container and the network carry the Compose project label, so teardown (`cluster_down`) finds what a
killed run left behind. The run-by-run backend over them is `harness.run.compose.ComposeBackend`.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

from harness import REPO_ROOT
from harness.errors import ClusterError
from harness.run.backend import Progress
from harness.run.certs import config_fields, write_cluster_tls
from harness.run.compose_file import NETWORK_LABEL, PROJECT_LABEL, load_project
from harness.run.docker_client import docker_client
from harness.run.image import DEFAULT_TAG
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
