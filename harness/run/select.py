"""Choosing a backend: ``docker``, ``local``, or ``auto``.

Every backend is a `harness.run.backend.Backend` (start / poll / stop / collect / teardown) driven by
the one loop `harness.run.loop.run_point`. A new one (e.g. ``swarm``: ``harness/run/swarm.py``,
services on a Swarm overlay network) is a class with those five methods, and one more name here.
"""

from __future__ import annotations

from harness.errors import ClusterError
from harness.run.backend import Backend, Progress


def select_backend(name: str, progress: Progress, image_tag: str | None = None) -> Backend:
    """``docker``, ``local`` or ``auto`` (docker when an engine answers, else local, saying which).
    `image_tag`: the node image for docker (default ``$WIIIIIDE_IMAGE`` or ``wiiide:latest``), built
    or refreshed here (seconds when cached).

    Raises:
        ClusterError: ``docker`` asked for and no engine, no Compose or no image can be had.
    """
    from harness.run.local import LocalBackend
    if name == "local":
        return LocalBackend()
    from harness.run.compose import ComposeBackend
    from harness.run.docker_client import engine_problem
    problem = engine_problem()
    if problem is None:
        backend = ComposeBackend(image_tag=image_tag)
        backend.prepare(progress)
        return backend
    if name == "docker":
        raise ClusterError(f"the docker backend needs a Docker engine: {problem}; "
                           "start one with `make docker-engine` (root) or use --backend local")
    progress(f"no Docker engine answered ({problem}): running on the local backend (processes on 127.0.0.1)")
    return LocalBackend()
