"""The base image the node image is built FROM (`harness.run.image`'s step 2), and the logged build
steps both use.

``python:3.11-slim`` if it is present or can be pulled; otherwise (no registry) a local Debian
bookworm base ``wiiide-base:bookworm-<digest of its package list>`` (`LOCAL_BASE`), made with
``debootstrap --variant=minbase`` into ``build/rootfs`` and ``docker import``. ``debootstrap`` needs
root; ``bash docker/engine.sh start`` installs it when it is missing.
"""

from __future__ import annotations

import collections
import hashlib
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Callable, Iterable, Optional, Sequence

from harness import REPO_ROOT
from harness.errors import ClusterError
from harness.run.docker_client import docker_client

ROOTFS = REPO_ROOT / "build" / "rootfs"
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
PULL_TIMEOUT_S = float(os.environ.get("WIIIIIDE_PULL_TIMEOUT", "60"))

Log = Callable[[str], None]


class BuildStep:
    """Logs the start and end (with elapsed seconds) of one build step."""

    def __init__(self, log: Log, what: str):
        self.log = log
        self.what = what
        self.t0 = 0.0

    def __enter__(self) -> "BuildStep":
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


def output_tail(lines: Iterable[str]) -> str:
    """The lines, stripped at the right, one string."""
    return "\n".join(line.rstrip() for line in lines)


def run_logged(cmd: Sequence[str], log: Log, *, echo: bool = True, cwd: Optional[Path] = None) -> None:
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
            f"command failed (exit {rc}): {' '.join(cmd)}\n--- last output ---\n{output_tail(tail)}"
        )


def image_exists(client, name: str) -> bool:
    """Whether the engine of `client` (a docker SDK client) has image `name`. Raises ClusterError
    when the engine cannot say."""
    import docker.errors

    try:
        client.images.get(name)
        return True
    except docker.errors.ImageNotFound:
        return False
    except docker.errors.APIError as e:
        raise ClusterError(f"cannot inspect image {name}: {e}") from e


def _try_pull(name: str, log: Log) -> bool:
    """Pulls name (short timeout). False, with the reason logged, if that does not work."""
    repo, _, tag = name.rpartition(":") if ":" in name.split("/")[-1] else (name, "", "latest")
    try:
        client = docker_client(timeout_s=PULL_TIMEOUT_S)
        for event in client.api.pull(repo, tag=tag, stream=True, decode=True):
            if "error" in event:
                log(f"[image] pull {name} failed: {event['error']}")
                return False
        return image_exists(client, name)
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
    if not force and image_exists(client, LOCAL_BASE):
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
        with BuildStep(log, f"debootstrap {DEBIAN_SUITE} into {ROOTFS.relative_to(REPO_ROOT)}") as step:
            run_logged(["debootstrap", "--variant=minbase", f"--include={DEBOOTSTRAP_PACKAGES}",
                        DEBIAN_SUITE, str(ROOTFS), DEBIAN_MIRROR], log)
            step.done()
        with BuildStep(log, f"docker import {LOCAL_BASE}") as step:
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
    with BuildStep(log, f"base image {wanted}") as step:
        client = docker_client()
        if wanted == LOCAL_BASE:
            base = build_local_base(force=force, log=log)
            step.done(base)
            return base
        if image_exists(client, wanted):
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
