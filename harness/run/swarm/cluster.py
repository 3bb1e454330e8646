"""The swarm itself: join the engine's swarm, or start a single-node one and mark it as the harness's
(a node label), and leave it again only when that mark is there."""

from __future__ import annotations

import os
from typing import Any

from harness.errors import ClusterError
from harness.run.backend import Progress
from harness.run.compose_project import PROJECT

STARTED_LABEL = "io.wiiide.harness.swarm-started-by"  # node label: the harness ran `swarm init` for this project
ADVERTISE_ENV = "WIIIIIDE_SWARM_ADVERTISE_ADDR"
SINGLE_NODE_ADDR = "127.0.0.1"  # a swarm the harness starts listens and advertises on loopback only


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
