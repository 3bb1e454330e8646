"""Build the Docker image that runs WIIIIIDE nodes (``wiiide:latest``, or ``$WIIIIIDE_IMAGE``).

Steps, each logged with the seconds it took:

1. Wheelhouse: ``pip download`` of the node's requirements (derived from ``pyproject.toml``: the
   ``[tool.wiiide-lab] node-packages`` with their versions from ``[project] dependencies``, written to
   ``build/wheelhouse/requirements-node.txt``) into ``build/wheelhouse`` on the host, so that the
   image installs its Python packages with ``--no-index`` (no network, and no HTTPS, needed inside
   the build).
2. Base image (`harness.run.base_image`): ``python:3.11-slim`` if it is present or can be pulled;
   otherwise (no registry) a local Debian bookworm base ``wiiide-base:bookworm-<digest of its
   package list>`` made with ``debootstrap`` and ``docker import``.
3. ``docker/Dockerfile`` built with the repo root as context (kept small by ``.dockerignore``).

Needs a running engine: ``bash docker/engine.sh start`` (root; it also installs docker.io,
docker-compose and debootstrap when they are missing).

Command line::

    wiiide-lab image [--force] [--base IMAGE] [--tag TAG]
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import os
import platform
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

from harness import REPO_ROOT
from harness.errors import ClusterError
from harness.run.base_image import (
    DEFAULT_BASE,
    LOCAL_BASE,
    BuildStep,
    Log,
    image_exists,
    output_tail,
    resolve_base,
    run_logged,
)
from harness.run.docker_client import docker_client

BUILD_DIR = REPO_ROOT / "build"
WHEELHOUSE = BUILD_DIR / "wheelhouse"
DOCKERFILE = "docker/Dockerfile"  # relative to the build context (REPO_ROOT)
PYPROJECT = REPO_ROOT / "pyproject.toml"
NODE_REQUIREMENTS = WHEELHOUSE / "requirements-node.txt"  # derived from PYPROJECT, see node_requirements()

# WIIIIIDE_IMAGE names another tag (e.g. one per checkout, so that two never overwrite each other's)
DEFAULT_TAG = os.environ.get("WIIIIIDE_IMAGE") or "wiiide:latest"
IMAGE_LABEL = "org.wiiide-lab.image"  # on every node image this project builds (replaced ones are pruned by it)
# The image's Python must match the wheels: bookworm's python3 and python:3.11-slim are both 3.11.
IMAGE_PYTHON = (3, 11)

BUILD_TIMEOUT_S = 3600

_STAMP = ".requirements.sha256"


# --------------------------------------------------------------------------------------------
# step 1: wheelhouse


def node_requirements(pyproject: Path = PYPROJECT) -> list[str]:
    """The requirement strings the node image installs, e.g. ``["torch==2.13.0", "numpy>=1.26", ...]``:
    every name of ``[tool.wiiide-lab] node-packages`` with its specifier from ``[project] dependencies``.

    Raises:
        ClusterError: pyproject.toml is missing, or names a node package that is not a dependency.
    """
    import tomllib

    from packaging.requirements import Requirement

    try:
        data = tomllib.loads(pyproject.read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ClusterError(f"cannot read the project's dependencies from {pyproject}: {e}") from e
    deps = {Requirement(d).name.lower(): d for d in data["project"]["dependencies"]}
    wanted = data.get("tool", {}).get("wiiide-lab", {}).get("node-packages", [])
    missing = [n for n in wanted if n.lower() not in deps]
    if missing:
        raise ClusterError(f"{pyproject}: node-packages {missing} are not in [project] dependencies")
    return [deps[n.lower()] for n in wanted]


def _requirements_digest(requirements: list[str]) -> str:
    h = hashlib.sha256("\n".join(requirements).encode())
    h.update(f"cp{IMAGE_PYTHON[0]}{IMAGE_PYTHON[1]}-x86_64".encode())
    return h.hexdigest()


def _host_matches_image() -> bool:
    return (
        sys.platform == "linux"
        and platform.machine() in ("x86_64", "AMD64")
        and sys.version_info[:2] == IMAGE_PYTHON
    )


def _platform_args() -> list:
    """pip download options for wheels of the image (cp311, x86_64, glibc 2.36) on another host."""
    args = ["--python-version", f"{IMAGE_PYTHON[0]}.{IMAGE_PYTHON[1]}", "--implementation", "cp",
            "--abi", f"cp{IMAGE_PYTHON[0]}{IMAGE_PYTHON[1]}", "--abi", "abi3", "--abi", "none"]
    platforms = ["manylinux1_x86_64", "manylinux2010_x86_64", "manylinux2014_x86_64"]
    platforms += [f"manylinux_2_{minor}_x86_64" for minor in range(5, 37)]
    for p in platforms:
        args += ["--platform", p]
    return args


def build_wheelhouse(force: bool = False, log: Log = print) -> Path:
    """Fills build/wheelhouse with wheels for everything the node needs (`node_requirements`), and
    writes those requirements to build/wheelhouse/requirements-node.txt for the Dockerfile."""
    with BuildStep(log, f"wheelhouse {WHEELHOUSE.relative_to(REPO_ROOT)}") as step:
        requirements = node_requirements()
        WHEELHOUSE.mkdir(parents=True, exist_ok=True)
        NODE_REQUIREMENTS.write_text("# derived from pyproject.toml by harness/run/image.py\n"
                                     + "\n".join(requirements) + "\n")
        stamp = WHEELHOUSE / _STAMP
        digest = _requirements_digest(requirements)
        if (
            not force
            and stamp.is_file()
            and stamp.read_text().strip() == digest
            and any(WHEELHOUSE.glob("torch-*.whl"))
        ):
            step.done(f"up to date ({len(list(WHEELHOUSE.glob('*.whl')))} wheels)")
            return WHEELHOUSE
        WHEELHOUSE.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--only-binary=:all:", "--progress-bar", "off",
               "--disable-pip-version-check", "--dest", str(WHEELHOUSE), "-r", str(NODE_REQUIREMENTS)]
        if not _host_matches_image():
            cmd += _platform_args()
        run_logged(cmd, log)
        stamp.write_text(digest + "\n")
        step.done(f"{len(list(WHEELHOUSE.glob('*.whl')))} wheels")
    return WHEELHOUSE


# --------------------------------------------------------------------------------------------
# step 3: the image


def _docker_build(tag: str, base: str, nocache: bool, log: Log) -> str:
    import docker.errors

    client = docker_client(timeout_s=BUILD_TIMEOUT_S)
    tail: collections.deque = collections.deque(maxlen=40)
    image_id = ""
    try:
        stream = client.api.build(
            path=str(REPO_ROOT),
            dockerfile=DOCKERFILE,
            tag=tag,
            buildargs={"BASE_IMAGE": base},
            rm=True,
            forcerm=True,
            nocache=nocache,
            decode=True,
            labels={IMAGE_LABEL: "node"},
        )
        for event in stream:
            if "stream" in event:
                for line in event["stream"].splitlines():
                    if line.strip():
                        tail.append(line)
                        log(f"    {line}")
            elif "error" in event:
                tail.append(event["error"])
                raise ClusterError(
                    f"docker build of {tag} (FROM {base}) failed: {event['error'].strip()}\n"
                    f"--- last output ---\n{output_tail(tail)}"
                )
            elif "aux" in event and isinstance(event["aux"], dict):
                image_id = event["aux"].get("ID", image_id)
    except docker.errors.DockerException as e:
        raise ClusterError(f"docker build of {tag} failed: {e}\n--- last output ---\n{output_tail(tail)}") from e
    if not image_exists(client, tag):
        raise ClusterError(f"docker build finished but {tag} is missing\n--- last output ---\n{output_tail(tail)}")
    _prune_replaced(client, log)
    return image_id


def _prune_replaced(client, log: Log) -> None:
    """Remove the node images this project built before and a rebuild left untagged (dangling, with
    `IMAGE_LABEL`); images of anyone else, tagged ones and those a container still uses stay.
    A failure is only logged: the new image is built either way."""
    try:
        pruned = client.images.prune(filters={"dangling": True, "label": f"{IMAGE_LABEL}=node"})
    except Exception as exc:  # docker.errors.APIError: e.g. a prune already running
        log(f"[image] could not remove replaced node images: {exc}")
        return
    removed = [i for i in (pruned.get("ImagesDeleted") or []) if i.get("Deleted")]
    if removed:
        log(f"[image] removed {len(removed)} layer(s) of replaced node images, "
            f"{(pruned.get('SpaceReclaimed') or 0) / 1e6:.0f} MB")


def build_image(tag: str = DEFAULT_TAG, base_image: Optional[str] = None, force: bool = False,
                log: Log = print) -> str:
    """Builds the node image and returns its tag.

    base_image: FROM image (default python:3.11-slim, falling back to a local debootstrap base
    when it can be neither found nor pulled). force: re-download the wheelhouse, rebuild the local
    base if that is the one used, and build without the layer cache.
    Raises ClusterError (with the failing command and its last output) on any failure.
    """
    t0 = time.monotonic()
    docker_client()  # fail early and clearly when there is no engine
    build_wheelhouse(force=force, log=log)
    base = resolve_base(base_image, force=force, log=log)
    with BuildStep(log, f"docker build {tag} FROM {base}") as step:
        image_id = _docker_build(tag, base, nocache=force, log=log)
        size = docker_client().images.get(tag).attrs.get("Size", 0)
        step.done(f"{image_id[:19] or tag}, {size / 1e6:.0f} MB")
    log(f"[image] {tag} ready ({time.monotonic() - t0:.1f}s in all)")
    return tag


def ensure_image(tag: str = DEFAULT_TAG, log: Log = print) -> str:
    """Returns tag, building the image first only if the engine does not have it yet."""
    if image_exists(docker_client(), tag):
        return tag
    log(f"[image] {tag} missing: building it")
    return build_image(tag=tag, log=log)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m harness.run.image [--force] [--base IMAGE] [--tag TAG]``; exit code 0, or 1 with the error."""
    parser = argparse.ArgumentParser(prog="python -m harness.run.image", description=__doc__.split("\n\n")[0])
    parser.add_argument("--force", action="store_true",
                        help="re-download wheels, rebuild the local base if used, build without cache")
    parser.add_argument("--base", metavar="IMAGE", default=None,
                        help=f"base image (default {DEFAULT_BASE}, else local {LOCAL_BASE})")
    parser.add_argument("--tag", default=DEFAULT_TAG, help=f"image tag (default {DEFAULT_TAG})")
    args = parser.parse_args(argv)
    try:
        build_image(tag=args.tag, base_image=args.base, force=args.force, log=lambda m: print(m, flush=True))
    except ClusterError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
