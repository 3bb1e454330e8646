"""Build the Docker image that runs WIIIIIDE nodes (``wiiide:latest``, or ``$WIIIIIDE_IMAGE``).

Steps, each logged with the seconds it took:

1. Wheelhouse: ``pip download`` of the node's requirements (derived from ``pyproject.toml``: the
   ``[tool.wiiide-lab] node-packages`` with their versions from ``[project] dependencies``, written to
   ``build/wheelhouse/requirements-node.txt``) into ``build/wheelhouse`` on the host, so that the image installs its Python packages with ``--no-index`` (no network, and no
   HTTPS, needed inside the build).
2. Base image: ``python:3.11-slim`` if it is present or can be pulled; otherwise (no registry) a
   local Debian bookworm base ``wiiide-base:bookworm-<digest of its package list>`` made with ``debootstrap`` and ``docker import``.
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
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Iterable, Optional, Sequence

from harness import REPO_ROOT
from harness.errors import ClusterError
from harness.run.docker_client import docker_client

BUILD_DIR = REPO_ROOT / "build"
WHEELHOUSE = BUILD_DIR / "wheelhouse"
ROOTFS = BUILD_DIR / "rootfs"
DOCKERFILE = "docker/Dockerfile"  # relative to the build context (REPO_ROOT)
PYPROJECT = REPO_ROOT / "pyproject.toml"
NODE_REQUIREMENTS = WHEELHOUSE / "requirements-node.txt"  # derived from PYPROJECT, see node_requirements()

# WIIIIIDE_IMAGE names another tag (e.g. one per checkout, so that two never overwrite each other's)
DEFAULT_TAG = os.environ.get("WIIIIIDE_IMAGE") or "wiiide:latest"
IMAGE_LABEL = "org.wiiide-lab.image"  # on every node image this project builds (replaced ones are pruned by it)
DEFAULT_BASE = "python:3.11-slim"
DEBIAN_SUITE = "bookworm"
DEBIAN_MIRROR = os.environ.get("WIIIIIDE_DEBIAN_MIRROR", "http://deb.debian.org/debian")
# iptables: the link fallback's loss rules (harness/links/fallback.py) where the kernel has no netem;
# libnetfilter-queue1: the runtime library of its delay line (docker/delayline, built in the image)
DEBOOTSTRAP_PACKAGES = "python3,python3-venv,iproute2,iperf3,iptables,libnetfilter-queue1,ca-certificates"
# the local base's tag carries a digest of its suite and package list, so that a base made from an
# older list is never reused: e.g. wiiide-base:bookworm-3f2a9c01
LOCAL_BASE = "wiiide-base:{}-{}".format(
    DEBIAN_SUITE, hashlib.sha256(f"{DEBIAN_SUITE}:{DEBOOTSTRAP_PACKAGES}".encode()).hexdigest()[:8])
# The image's Python must match the wheels: bookworm's python3 and python:3.11-slim are both 3.11.
IMAGE_PYTHON = (3, 11)

PULL_TIMEOUT_S = float(os.environ.get("WIIIIIDE_PULL_TIMEOUT", "60"))
BUILD_TIMEOUT_S = 3600

Log = Callable[[str], None]

_STAMP = ".requirements.sha256"


# --------------------------------------------------------------------------------------------
# helpers


class _Step:
    """Logs the start and end (with elapsed seconds) of one build step."""

    def __init__(self, log: Log, what: str):
        self.log = log
        self.what = what
        self.t0 = 0.0

    def __enter__(self) -> "_Step":
        self.t0 = time.monotonic()
        self.log(f"[image] {self.what} ...")
        return self

    def elapsed(self) -> float:
        """Seconds since the step began."""
        return time.monotonic() - self.t0

    def done(self, note: str = "") -> None:
        """Log the step's end with `note` and its seconds."""
        self.log(f"[image] {self.what}: {note or 'done'} ({self.elapsed():.1f}s)")

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.log(f"[image] {self.what}: FAILED after {self.elapsed():.1f}s")


def _tail(lines: Iterable[str]) -> str:
    return "\n".join(line.rstrip() for line in lines)


def _run(cmd: Sequence[str], log: Log, *, echo: bool = True, cwd: Optional[Path] = None) -> None:
    """Runs cmd, echoing its output lines (stdout+stderr) to log; raises ClusterError on failure."""
    tail: collections.deque = collections.deque(maxlen=40)
    try:
        proc = subprocess.Popen(
            list(cmd),
            cwd=str(cwd) if cwd else None,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            errors="replace",
        )
    except OSError as e:
        raise ClusterError(f"cannot run {' '.join(cmd)}: {e}") from e
    assert proc.stdout is not None
    for line in proc.stdout:
        line = line.rstrip("\n")
        tail.append(line)
        if echo and line.strip():
            log(f"    {line}")
    rc = proc.wait()
    if rc != 0:
        raise ClusterError(
            f"command failed (exit {rc}): {' '.join(cmd)}\n--- last output ---\n{_tail(tail)}"
        )


def _image_exists(client, name: str) -> bool:
    import docker.errors

    try:
        client.images.get(name)
        return True
    except docker.errors.ImageNotFound:
        return False
    except docker.errors.APIError as e:
        raise ClusterError(f"cannot inspect image {name}: {e}") from e


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
    with _Step(log, f"wheelhouse {WHEELHOUSE.relative_to(REPO_ROOT)}") as step:
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
        _run(cmd, log)
        stamp.write_text(digest + "\n")
        step.done(f"{len(list(WHEELHOUSE.glob('*.whl')))} wheels")
    return WHEELHOUSE


# --------------------------------------------------------------------------------------------
# step 2: base image


def _try_pull(name: str, log: Log) -> bool:
    """Pulls name (short timeout). False, with the reason logged, if that does not work."""
    repo, _, tag = name.rpartition(":") if ":" in name.split("/")[-1] else (name, "", "latest")
    try:
        client = docker_client(timeout_s=PULL_TIMEOUT_S)
        for event in client.api.pull(repo, tag=tag, stream=True, decode=True):
            if "error" in event:
                log(f"[image] pull {name} failed: {event['error']}")
                return False
        return _image_exists(client, name)
    except ClusterError:
        raise
    except Exception as e:  # APIError (no registry), ReadTimeout, ConnectionError
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        log(f"[image] pull {name} failed: {reason}")
        return False


def _mounts_under(path: Path) -> list:
    prefix = str(path.resolve())
    found = []
    try:
        with open("/proc/mounts") as f:
            for line in f:
                mnt = line.split()[1].replace("\\040", " ")
                if mnt == prefix or mnt.startswith(prefix + "/"):
                    found.append(mnt)
    except OSError:
        pass
    return found


def _remove_rootfs(log: Log) -> None:
    """Removes build/rootfs, first unmounting what an interrupted debootstrap left mounted in it."""
    if not ROOTFS.exists():
        return
    for mnt in sorted(_mounts_under(ROOTFS), key=len, reverse=True):
        log(f"[image] unmounting leftover {mnt}")
        subprocess.run(["umount", "-l", mnt], check=False)
    left = _mounts_under(ROOTFS)
    if left:
        raise ClusterError(f"cannot remove {ROOTFS}: still mounted: {', '.join(left)}")
    shutil.rmtree(ROOTFS)


def build_local_base(force: bool = False, log: Log = print) -> str:
    """Makes LOCAL_BASE (Debian bookworm minbase + DEBOOTSTRAP_PACKAGES) without any registry."""
    client = docker_client()
    if not force and _image_exists(client, LOCAL_BASE):
        log(f"[image] local base {LOCAL_BASE} exists")
        return LOCAL_BASE
    if os.geteuid() != 0:
        raise ClusterError(f"building {LOCAL_BASE} with debootstrap needs root")
    if not shutil.which("debootstrap"):
        raise ClusterError(
            "debootstrap is missing: `bash docker/engine.sh start` installs it "
            "(or apt-get install -y debootstrap)"
        )
    _remove_rootfs(log)
    ROOTFS.parent.mkdir(parents=True, exist_ok=True)
    try:
        with _Step(log, f"debootstrap {DEBIAN_SUITE} into {ROOTFS.relative_to(REPO_ROOT)}") as step:
            _run(["debootstrap", "--variant=minbase", f"--include={DEBOOTSTRAP_PACKAGES}",
                  DEBIAN_SUITE, str(ROOTFS), DEBIAN_MIRROR], log)
            step.done()
        with _Step(log, f"docker import {LOCAL_BASE}") as step:
            _import_rootfs(LOCAL_BASE, log)
            step.done()
    finally:
        _remove_rootfs(log)
    return LOCAL_BASE


def _import_rootfs(name: str, log: Log) -> None:
    """tar -C build/rootfs -c . | docker import - name (without apt's downloaded .debs and lists)."""
    if not shutil.which("docker"):
        raise ClusterError("the docker client is missing: `bash docker/engine.sh start` installs it")
    tar_cmd = ["tar", "--numeric-owner", "-C", str(ROOTFS),
               "--exclude=./var/cache/apt/archives/*.deb", "--exclude=./var/lib/apt/lists/*",
               "-c", "."]
    import_cmd = ["docker", "import",
                  "--change", "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                  "--change", "ENV LANG=C.UTF-8",
                  "--change", 'CMD ["/bin/bash"]',
                  "-", name]
    tar = subprocess.Popen(tar_cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert tar.stdout is not None
    try:
        imp = subprocess.run(import_cmd, stdin=tar.stdout, capture_output=True, text=True)
    finally:
        tar.stdout.close()
        tar_err = tar.stderr.read().decode(errors="replace") if tar.stderr else ""
        tar_rc = tar.wait()
    if tar_rc != 0:
        raise ClusterError(f"command failed (exit {tar_rc}): {' '.join(tar_cmd)}\n{tar_err[-3000:]}")
    if imp.returncode != 0:
        raise ClusterError(
            f"command failed (exit {imp.returncode}): {' '.join(import_cmd)}\n"
            f"{(imp.stdout + imp.stderr)[-3000:]}"
        )
    log(f"    {imp.stdout.strip()}")


def resolve_base(base_image: Optional[str] = None, force: bool = False, log: Log = print) -> str:
    """The base image to build FROM: present locally, pulled, or (default only) made locally."""
    wanted = base_image or os.environ.get("WIIIIIDE_BASE_IMAGE") or DEFAULT_BASE
    with _Step(log, f"base image {wanted}") as step:
        client = docker_client()
        if wanted == LOCAL_BASE:
            base = build_local_base(force=force, log=log)
            step.done(base)
            return base
        if _image_exists(client, wanted):
            step.done(f"{wanted} present")
            return wanted
        if _try_pull(wanted, log):
            step.done(f"pulled {wanted}")
            return wanted
        if wanted != DEFAULT_BASE:
            raise ClusterError(
                f"base image {wanted} is neither present nor pullable; "
                f"omit --base to fall back to a local Debian base ({LOCAL_BASE})"
            )
        log(f"[image] no registry: falling back to local base {LOCAL_BASE}")
        base = build_local_base(force=force, log=log)
        step.done(base)
        return base


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
                    f"--- last output ---\n{_tail(tail)}"
                )
            elif "aux" in event and isinstance(event["aux"], dict):
                image_id = event["aux"].get("ID", image_id)
    except docker.errors.DockerException as e:
        raise ClusterError(f"docker build of {tag} failed: {e}\n--- last output ---\n{_tail(tail)}") from e
    if not _image_exists(client, tag):
        raise ClusterError(f"docker build finished but {tag} is missing\n--- last output ---\n{_tail(tail)}")
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
    with _Step(log, f"docker build {tag} FROM {base}") as step:
        image_id = _docker_build(tag, base, nocache=force, log=log)
        size = docker_client().images.get(tag).attrs.get("Size", 0)
        step.done(f"{image_id[:19] or tag}, {size / 1e6:.0f} MB")
    log(f"[image] {tag} ready ({time.monotonic() - t0:.1f}s in all)")
    return tag


def ensure_image(tag: str = DEFAULT_TAG, log: Log = print) -> str:
    """Returns tag, building the image first only if the engine does not have it yet."""
    if _image_exists(docker_client(), tag):
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
