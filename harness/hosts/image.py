"""The host image: the project's local Debian base (`harness.run.base_image.LOCAL_BASE`, debootstrap) plus
Debian's docker.io and docker-registry (docker/host.Dockerfile, docker/host-init.sh).

Tagged ``wiiide-host:<digest>``, the digest over the base's tag and both files, so that a change of
either rebuilds it and anything else reuses it (about 15 s to build once the base exists)."""

from __future__ import annotations

import hashlib

from harness import REPO_ROOT
from harness.errors import ClusterError
from harness.run.base_image import LOCAL_BASE, Log, build_local_base
from harness.run.docker_client import docker_client
from harness.run.image import IMAGE_LABEL

CONTEXT = REPO_ROOT / "docker"
DOCKERFILE = "host.Dockerfile"
INPUTS = ("host.Dockerfile", "host-init.sh")  # in CONTEXT: what the image is built from
REPOSITORY = "wiiide-host"
BUILD_TIMEOUT_S = 900


def host_image_tag(base: str = LOCAL_BASE) -> str:
    """``wiiide-host:<first 8 hex digits of sha256(base tag, then each file of INPUTS)>``.

    Raises:
        ClusterError: a file of INPUTS cannot be read.
    """
    digest = hashlib.sha256(base.encode())
    for name in INPUTS:
        try:
            digest.update((CONTEXT / name).read_bytes())
        except OSError as exc:
            raise ClusterError(f"the host image's {name} cannot be read: {exc}") from None
    return f"{REPOSITORY}:{digest.hexdigest()[:8]}"


def ensure_host_image(log: Log = print) -> str:
    """The host image's tag, building the local base and then the image when missing.

    Raises:
        ClusterError: no engine, the base cannot be made (needs root and debootstrap), or the build failed
            (with its last output).
    """
    import docker.errors

    tag = host_image_tag()
    client = docker_client(timeout_s=BUILD_TIMEOUT_S)
    try:
        client.images.get(tag)
        return tag
    except docker.errors.ImageNotFound:
        pass
    base = build_local_base(log=log)
    log(f"[hosts] building {tag} FROM {base} (docker.io, docker-registry from the Debian mirror)")
    tail: list[str] = []
    try:
        for event in client.api.build(path=str(CONTEXT), dockerfile=DOCKERFILE, tag=tag, buildargs={"BASE_IMAGE": base},
                                      rm=True, forcerm=True, decode=True, labels={IMAGE_LABEL: "host"}):
            if "error" in event:
                raise ClusterError(f"docker build of {tag} failed: {event['error'].strip()}\n" + "\n".join(tail[-20:]))
            tail.extend(line for line in event.get("stream", "").splitlines() if line.strip())
    except docker.errors.DockerException as exc:
        raise ClusterError(f"docker build of {tag} failed: {exc}") from None
    return tag
