"""The harness's one way to reach the Docker engine: a docker SDK client, or why there is none.

Every module that talks to the Engine API (compose, swarm, image, link shaping, stats, bench-wire,
status) gets its client here, so the errors and the hint to start an engine are the same everywhere.
"""

from __future__ import annotations

from harness.errors import ClusterError

ENGINE_HINT = "start one with `bash docker/engine.sh start` (or `make docker-engine`)"


def docker_client(timeout_s: float = 60, ping: bool = True, base_url: str | None = None):
    """A `docker.DockerClient` from the environment (DOCKER_HOST or the local socket), or of the engine
    at `base_url` (``ssh://user@host``, ``tcp://host:2376``: another node of a swarm).

    Args:
        timeout_s: the SDK's timeout for one API call, seconds.
        ping: check that the engine answers before returning.

    Raises:
        ClusterError: the `docker` package is missing, or no engine answers (with how to start one).
    """
    try:
        import docker  # the SDK; imported here so that modules load without it
    except ImportError as e:
        raise ClusterError("the Python package `docker` is missing: pip install -e .") from e
    try:
        if base_url:
            client = docker.DockerClient(base_url=base_url, timeout=int(timeout_s), use_ssh_client=base_url.startswith("ssh://"))
        else:
            client = docker.from_env(timeout=int(timeout_s))
        if ping:
            client.ping()
    except Exception as e:  # DockerException, requests errors: all mean "no engine here"
        raise ClusterError(f"no Docker engine answers ({e}); {ENGINE_HINT}") from e
    return client


def engine_problem() -> str | None:
    """None when a Docker engine answers a ping within 5 s, else why not (one line)."""
    try:
        client = docker_client(timeout_s=5)
    except ClusterError as e:
        return str(e)
    client.close()
    return None
