"""One run's stack: the two files generated from compose.yaml, ``docker stack deploy``, and removing
everything of the stack again (services, task containers, overlay network, secret)."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

import yaml

from harness import REPO_ROOT
from harness.errors import ClusterError
from harness.run.backend import Progress
from harness.run.compose_project import PROJECT, compose_env
from harness.run.swarm.cluster import swarm_info
from harness.run.swarm.encryption import encrypted_vnis, remove_rules_for
from wiiide.config import RunConfig

COMPOSE_FILE = REPO_ROOT / "compose.yaml"
STACK_LABEL = "com.docker.stack.namespace"  # put by `docker stack deploy` on services, networks, secrets, configs
MAX_PER_NODE_ENV = "WIIIIIDE_SWARM_MAX_REPLICAS_PER_NODE"
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
ENCRYPTED_OPTION = "encrypted"  # the overlay driver's option, as in `docker network create --opt encrypted`
TEARDOWN_WAIT_S = 60.0  # seconds for Swarm to remove a stack's task containers before its network goes


def stack_name(project: str = PROJECT) -> str:
    """The stack of a project's runs: ``<project>-stack`` (services ``<stack>_coordinator``, ``<stack>_worker``)."""
    return f"{project}-stack"


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


def stack_override(num_workers: int, network: str, max_replicas_per_node: int | None = None,
                   encrypted: bool = False) -> dict[str, Any]:
    """What Swarm needs on top of `stack_base` for one run of `num_workers` workers on the project
    network `network` (see the module docstring for why each key). Pure.

    `max_replicas_per_node`: ``deploy.placement.max_replicas_per_node`` of the workers (spreads them over
    the nodes of a multi-node swarm; None: no limit).
    `encrypted`: the overlay gets ``driver_opts: {encrypted: ""}`` (``docker network create --opt
    encrypted``): libnetwork then keys IPsec ESP (AES-GCM) between the nodes that have tasks on it. Traffic
    between two tasks on the same node never leaves that node's bridge and is not encrypted.
    """
    def deploy(replicas: int) -> dict[str, Any]:
        return {"mode": "replicated", "replicas": replicas, "endpoint_mode": "dnsrr",
                "restart_policy": {"condition": "none"}}

    worker = {"hostname": "worker-{{.Task.Slot}}", "deploy": deploy(num_workers)}
    if max_replicas_per_node:
        worker["deploy"]["placement"] = {"max_replicas_per_node": int(max_replicas_per_node)}
    return {"services": {"coordinator": {"deploy": deploy(1)}, "worker": worker},
            "networks": {network: {"driver": "overlay", "internal": True,
                                   **({"driver_opts": {ENCRYPTED_OPTION: ""}} if encrypted else {})}}}


def write_stack_files(folder: Path, num_workers: int, compose_file: Path = COMPOSE_FILE,
                      encrypted: bool = False, max_replicas_per_node: int | None = None) -> list[Path]:
    """Write ``stack-base.yaml`` and ``stack-override.yaml`` into `folder`; return both paths, in the
    order ``docker stack deploy -c`` takes them. `encrypted`, `max_replicas_per_node`: see
    `stack_override` (the latter by default from `MAX_PER_NODE_ENV`).

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
    max_per_node = max_replicas_per_node or os.environ.get(MAX_PER_NODE_ENV)
    folder.mkdir(parents=True, exist_ok=True)
    paths = [folder / "stack-base.yaml", folder / "stack-override.yaml"]
    header = f"# generated by harness.run.swarm from {compose_file.name}; not kept by hand\n"
    for path, data in zip(paths, (stack_base(compose),
                                  stack_override(num_workers, networks[0], int(max_per_node) if max_per_node else None,
                                                 encrypted))):
        path.write_text(header + yaml.safe_dump(data, sort_keys=False))
    return paths


def stack_env(cfg: RunConfig, results_dir: Path, image: str, extra_env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment ``docker stack deploy`` interpolates compose.yaml's ``${WIIIIIDE_*}`` from: the
    same as Compose's (`harness.run.compose_project.compose_env`) plus `extra_env` (role-wide limits)."""
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
    ``networks``, ``secrets``, ``configs`` (docker SDK objects, found by `STACK_LABEL`). Containers are
    listed without inspecting each (``sparse``): Swarm removes them while this looks, and an inspect of
    one just removed would fail."""
    label = {"label": f"{STACK_LABEL}={stack}"}
    return {"services": client.services.list(filters=label),
            "containers": client.containers.list(all=True, filters=label, sparse=True),
            "networks": client.networks.list(filters=label),
            "secrets": client.secrets.list(filters=label),
            "configs": client.configs.list(filters=label)}


def object_name(obj) -> str:
    """The name of a docker SDK object of `stack_objects` (a sparse container's from its ``Names``), or its id."""
    names = (getattr(obj, "attrs", None) or {}).get("Names") or []
    return getattr(obj, "name", None) or (names[0].lstrip("/") if names else obj.id)


def remove_stack(client, stack: str, progress: Progress, wait_s: float = TEARDOWN_WAIT_S) -> None:
    """Remove `stack` as ``docker stack rm`` does, and wait until it is gone: its services (Swarm then
    removes their task containers), then, once no task container is left, its networks, secrets and
    configs. A no-op for a stack that is not there. An encrypted overlay's iptables rules (which Engine
    < 24 leaves after the network: `harness.run.swarm.encryption`) are deleted after it, on this host.

    Raises:
        ClusterError: something of the stack is still there after `wait_s` seconds (naming it).
    """
    if swarm_info(client).get("LocalNodeState") != "active":
        return
    vnis = [vni for network in stack_objects(client, stack)["networks"] for vni in encrypted_vnis(network.attrs)]
    remove_stack_objects(client, stack, progress, wait_s)
    remove_rules_for(vnis, progress)  # what an encrypted overlay leaves in iptables on Engine < 24


def remove_stack_objects(client, stack: str, progress: Progress, wait_s: float = TEARDOWN_WAIT_S) -> None:
    """`remove_stack` without the iptables part. Raises ClusterError (see there)."""
    for service in stack_objects(client, stack)["services"]:
        try:
            service.remove()
        except Exception as exc:  # docker.errors.NotFound: gone meanwhile
            if type(exc).__name__ != "NotFound":
                progress(f"    swarm: removing service {service.name}: {exc}")
    deadline = time.monotonic() + wait_s
    left: dict[str, list] = {}
    while True:
        try:
            left = stack_objects(client, stack)
            if not left["containers"] and not left["services"]:
                for kind in ("networks", "secrets", "configs"):
                    for obj in left[kind]:
                        try:
                            obj.remove()
                        except Exception as exc:  # the network's endpoints are still being released: retry
                            if type(exc).__name__ != "NotFound" and time.monotonic() > deadline:
                                progress(f"    swarm: removing {kind[:-1]} {object_name(obj)}: {exc}")
                left = stack_objects(client, stack)
                if not any(left.values()):
                    return
        except Exception as exc:  # docker.errors.APIError while Swarm removes things: look again
            if time.monotonic() > deadline:
                raise ClusterError(f"stack {stack}: cannot list what is left of it: {exc}") from None
        if time.monotonic() > deadline:
            names = {k: [object_name(o) for o in v] for k, v in left.items() if v}
            raise ClusterError(f"stack {stack} still has {names} after {wait_s:.0f} s; "
                               f"`docker stack rm {stack}` and check `docker service ls`")
        time.sleep(0.5)
