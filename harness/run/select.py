"""Choosing a backend: ``docker``, ``swarm``, ``local``, or ``auto``.

Every backend is a `harness.run.backend.Backend` (start / poll / stop / collect / teardown) driven by
the one loop `harness.run.loop.run_point`; ``swarm`` is `harness.run.swarm.SwarmBackend` (one stack
per run on a Docker Swarm overlay network).
"""

from __future__ import annotations

from harness.errors import ClusterError
from harness.run.backend import Backend, Progress


def select_backend(name: str, progress: Progress, image_tag: str | None = None, reuse: bool = False) -> Backend:
    """``docker``, ``swarm``, ``local`` or ``auto`` (docker when an engine answers, else local, saying which).
    `image_tag`: the node image for docker and swarm (default ``$WIIIIIDE_IMAGE`` or ``wiiide:latest``),
    built or refreshed here (seconds when cached). `reuse`: docker keeps warm containers between runs
    of the same cluster (`harness.run.compose.ComposeBackend`; the caller must `close` it at the end).

    Raises:
        ClusterError: ``docker`` or ``swarm`` asked for and no engine, no Compose, no swarm or no image
            can be had.
    """
    from harness.run.local import LocalBackend
    if name == "local":
        return LocalBackend()
    if name == "swarm":
        from harness.run.docker_client import engine_problem
        problem = engine_problem()
        if problem is not None:
            raise ClusterError(f"the swarm backend needs a Docker engine: {problem}")
        from harness.run.swarm import SwarmBackend
        swarm = SwarmBackend(image_tag=image_tag, progress=progress)
        swarm.prepare(progress)
        return swarm
    from harness.run.compose import ComposeBackend
    from harness.run.docker_client import engine_problem
    problem = engine_problem()
    if problem is None:
        backend = ComposeBackend(image_tag=image_tag, reuse=reuse)
        backend.prepare(progress)
        return backend
    if name == "docker":
        raise ClusterError(f"the docker backend needs a Docker engine: {problem}; "
                           "start one with `make docker-engine` (root) or use --backend local")
    progress(f"no Docker engine answered ({problem}): running on the local backend (processes on 127.0.0.1)")
    return LocalBackend()
