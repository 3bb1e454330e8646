"""Two containers of the node image on a bridge of their own: a sink, and a source that writes its
result JSON into a mounted folder. What a two-peer benchmark needs on the docker backend (bench-tls;
bench-wire's `run_docker` does the same and can move onto it)."""

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


def run_pair(name: str, sink: Peer, source: Peer, result_file: Path, progress: Callable[[str], None],
             wait_s: float = 60.0) -> tuple[dict[str, Any], dict[str, Any]]:
    """Build the image if stale, start `sink` then `source` on a new bridge network labelled with the
    project, stream the source's output to `progress`, read `result_file` (on the host; the source
    writes it through a mount) once the source exits 0, and remove containers and network.

    Returns:
        (the result JSON, the ``backend`` entry: engine version, image, project).

    Raises:
        ClusterError: no engine, the image did not build, or the source exited non-zero (its last lines).
    """
    from harness.errors import ClusterError
    from harness.run.compose import DEFAULT_IMAGE, PROJECT, PROJECT_LABEL, SERVICE_LABEL
    from harness.run.docker_client import docker_client
    from harness.run.image import build_image

    client = docker_client(timeout_s=600)
    build_image(log=progress)
    labels = {PROJECT_LABEL: PROJECT, SERVICE_LABEL: name}
    stamp = datetime.now(timezone.utc).strftime("%H%M%S")
    network = client.networks.create(f"{PROJECT}-{name}-{stamp}", driver="bridge", labels=labels)
    started = []
    try:
        for role, peer in (("sink", sink), ("source", source)):
            started.append(client.containers.run(
                DEFAULT_IMAGE, list(peer.command), name=f"{PROJECT}-{name}-{role}-{stamp}", hostname=peer.hostname,
                detach=True, network=network.name, labels=labels,
                volumes={host: {"bind": bind, "mode": mode} for host, (bind, mode) in peer.mounts.items()}))
        src = started[-1]
        for line in src.logs(stream=True, follow=True):
            progress(line.decode(errors="replace").rstrip())
        code = src.wait(timeout=wait_s).get("StatusCode")
        if code != 0:
            raise ClusterError(f"{name} source container exited {code}: {src.logs(tail=20).decode(errors='replace')}")
        result = json.loads(result_file.read_text())
        backend = {"engine_version": client.version().get("Version"), "image": DEFAULT_IMAGE, "project": PROJECT}
    finally:
        for c in started:
            try:
                c.remove(force=True)
            except Exception as exc:  # keep removing the rest; report what is left
                progress(f"could not remove container {c.name}: {exc}")
        network.remove()
    return result, backend
