"""Two containers of the node image on a bridge of their own (or on networks given, e.g. two overlays):
a sink, and a source that writes its result JSON into a mounted folder. What a two-peer benchmark needs
on the docker backend (bench-tls, bench-overlay, bench-wire)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Sequence


@dataclass(frozen=True)
class Peer:
    """One container: its command (argv), hostname and bind mounts (host path -> (container path, mode))."""

    command: Sequence[str]
    hostname: str
    mounts: dict[str, tuple[str, str]]


@dataclass(frozen=True)
class PairNetwork:
    """One network both peers join (created for the pair, removed after): its name is
    ``<project>-<bench>-<suffix>-<stamp>``, its `driver` and driver `options` (``docker network create
    --opt``); each peer is reachable on it as ``<hostname>-<suffix>`` (a network-scoped alias)."""

    suffix: str
    driver: str = "overlay"
    options: dict[str, str] | None = None


def run_pair(name: str, sink: Peer, source: Peer, result_file: Path, progress: Callable[[str], None],
             wait_s: float = 60.0, networks: Sequence[PairNetwork] = (),
             probe: Callable[[list], dict[str, Any]] | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """Build the image if stale, start `sink` then `source` on a new bridge network labelled with the
    project, stream the source's output to `progress`, read `result_file` (on the host; the source
    writes it through a mount) once the source exits 0, and remove containers and network.

    `networks`: instead of the bridge, create these (internal; overlays attachable, which needs an
    active swarm) and attach each peer to all of them before it starts; the ``backend`` entry then lists
    them (name, id, driver, options) as ``networks``. `probe`: called with the created networks (docker
    SDK objects) once the source exited 0, before anything is removed; what it returns is the
    ``backend`` entry's ``probe``.

    Returns:
        (the result JSON, the ``backend`` entry: engine version, image, project).

    Raises:
        ClusterError: no engine, the image did not build, or the source exited non-zero (its last lines).
    """
    from harness.errors import ClusterError
    from harness.run.compose_file import PROJECT_LABEL, SERVICE_LABEL
    from harness.run.compose_project import DEFAULT_IMAGE, PROJECT
    from harness.run.docker_client import docker_client
    from harness.run.image import build_image

    client = docker_client(timeout_s=600)
    build_image(log=progress)
    labels = {PROJECT_LABEL: PROJECT, SERVICE_LABEL: name}
    stamp = datetime.now(timezone.utc).strftime("%H%M%S")
    created = []
    started = []
    try:
        if not networks:
            created.append(client.networks.create(f"{PROJECT}-{name}-{stamp}", driver="bridge", labels=labels))
        for net in networks:
            created.append(client.networks.create(
                f"{PROJECT}-{name}-{net.suffix}-{stamp}", driver=net.driver, options=dict(net.options or {}),
                internal=True, attachable=net.driver == "overlay", labels=labels))
        for role, peer in (("sink", sink), ("source", source)):
            volumes = {host: {"bind": bind, "mode": mode} for host, (bind, mode) in peer.mounts.items()}
            if not networks:
                started.append(client.containers.run(
                    DEFAULT_IMAGE, list(peer.command), name=f"{PROJECT}-{name}-{role}-{stamp}",
                    hostname=peer.hostname, detach=True, network=created[0].name, labels=labels, volumes=volumes))
                continue
            aliases = {n.name: [f"{peer.hostname}-{spec.suffix}"] for n, spec in zip(created, networks)}
            container = client.containers.create(
                DEFAULT_IMAGE, list(peer.command), name=f"{PROJECT}-{name}-{role}-{stamp}", hostname=peer.hostname,
                network=created[0].name, labels=labels, volumes=volumes,
                networking_config={created[0].name: client.api.create_endpoint_config(aliases=aliases[created[0].name])})
            started.append(container)
            for net in created[1:]:
                net.connect(container, aliases=aliases[net.name])
            container.start()
        src = started[-1]
        for line in src.logs(stream=True, follow=True):
            progress(line.decode(errors="replace").rstrip())
        code = src.wait(timeout=wait_s).get("StatusCode")
        if code != 0:
            raise ClusterError(f"{name} source container exited {code}: {src.logs(tail=20).decode(errors='replace')}")
        result = json.loads(result_file.read_text())
        probed = probe(created) if probe else None
        backend = {"engine_version": client.version().get("Version"), "image": DEFAULT_IMAGE, "project": PROJECT}
        if networks:
            backend["networks"] = [{"name": n.name, "id": n.id[:12], "driver": spec.driver,
                                    "options": dict(spec.options or {})} for n, spec in zip(created, networks)]
        if probe:
            backend["probe"] = probed
    finally:
        for c in started:
            try:
                c.remove(force=True)
            except Exception as exc:  # keep removing the rest; report what is left
                progress(f"could not remove container {c.name}: {exc}")
        for net in created:
            net.remove()
    return result, backend
