"""Choosing a backend: ``docker``, ``swarm``, ``local``, or ``auto``.

Every backend is a `harness.run.backend.Backend` (start / poll / stop / collect / teardown) driven by
the one loop `harness.run.loop.run_point`; ``swarm`` is `harness.run.swarm.SwarmBackend` (one stack
per run on a Docker Swarm overlay network).
"""

from __future__ import annotations

from harness.errors import ClusterError
from harness.run.backend import Backend, Progress


def backend_class(name: str, progress: Progress) -> type:
    """The class of backend `name` (``docker``, ``swarm``, ``local`` or ``auto``: docker when an engine
    answers, else local, saying which through `progress`), built or prepared in nothing: its
    `check_cluster` and `check_faults` are classmethods (``sweep --dry-run``).

    Raises:
        ClusterError: ``docker`` or ``swarm`` asked for and no Docker engine answers.
    """
    from harness.run.local import LocalBackend
    if name == "local":
        return LocalBackend
    from harness.run.docker_client import engine_problem
    problem = engine_problem()
    if name == "swarm":
        if problem is not None:
            raise ClusterError(f"the swarm backend needs a Docker engine: {problem}")
        from harness.run.swarm import SwarmBackend
        return SwarmBackend
    if problem is None:
        from harness.run.compose import ComposeBackend
        return ComposeBackend
    if name == "docker":
        raise ClusterError(f"the docker backend needs a Docker engine: {problem}; or use --backend local")
    progress(f"no Docker engine answered ({problem}): running on the local backend (processes on 127.0.0.1)")
    return LocalBackend


def select_backend(name: str, progress: Progress, image_tag: str | None = None, reuse: bool = False) -> Backend:
    """``docker``, ``swarm``, ``local`` or ``auto`` (docker when an engine answers, else local, saying which:
    `backend_class`). `image_tag`: the node image for docker and swarm (default ``$WIIIIIDE_IMAGE`` or
    ``wiiide:latest``), built or refreshed here (seconds when cached). `reuse`: docker keeps warm containers
    between runs of the same cluster (`harness.run.compose.ComposeBackend`; the caller must `close` it at
    the end).

    Raises:
        ClusterError: ``docker`` or ``swarm`` asked for and no engine, no Compose, no swarm or no image
            can be had.
    """
    cls = backend_class(name, progress)
    if cls.name == "local":
        return cls()
    if cls.name == "swarm":
        backend = cls(image_tag=image_tag, progress=progress)
    else:
        backend = cls(image_tag=image_tag, reuse=reuse)
    backend.prepare(progress)
    return backend
