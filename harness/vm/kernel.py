"""Debian's kernel for the VM, and the host tools that boot it: `HOST_PACKAGES` installed with apt-get
(as root, when a tool is missing), the ``linux-image-amd64`` metapackage resolved to its image package
(``linux-image-6.1.0-NN-amd64``), that package's .deb fetched with ``apt-get download`` into the build
folder (nothing is installed on the host's /boot) and unpacked there with ``dpkg-deb -x``.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from harness.errors import ClusterError

# Debian packages the VM needs on the host, and the tool each provides (checked with shutil.which)
HOST_PACKAGES = {"qemu-system-x86": "qemu-system-x86_64", "busybox-static": "busybox", "cpio": "cpio"}
KERNEL_METAPACKAGE = "linux-image-amd64"
APT_TIMEOUT_S = 900


@dataclass(frozen=True)
class Kernel:
    """An unpacked kernel package: its `version` (``6.1.0-57-amd64``), `vmlinuz` (the bzImage), its
    `modules_dir` (``lib/modules/<version>``) and the `deb` it came from."""

    version: str
    vmlinuz: Path
    modules_dir: Path
    deb: Path


def missing_tools() -> dict[str, str]:
    """The `HOST_PACKAGES` whose tool is not on PATH: ``{package: tool}``. Raises nothing."""
    return {pkg: tool for pkg, tool in HOST_PACKAGES.items() if shutil.which(tool) is None}


def _run(argv: list[str], cwd: Path | None = None) -> str:
    try:
        done = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=APT_TIMEOUT_S, check=False,
                              env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ClusterError(f"netem VM: `{' '.join(argv)}` could not run: {exc}") from None
    if done.returncode != 0:
        raise ClusterError(f"netem VM: `{' '.join(argv)}` failed (exit {done.returncode}): "
                           f"{(done.stderr or done.stdout).strip()[-400:]}")
    return done.stdout


def ensure_host_packages(log: Callable[[str], None]) -> None:
    """Install the missing `HOST_PACKAGES` with apt-get (root only).

    Raises:
        ClusterError: a tool is missing and this is not root or there is no apt-get, or apt-get failed.
    """
    missing = missing_tools()
    if not missing:
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise ClusterError(f"netem VM: {', '.join(missing.values())} missing; install Debian's "
                           f"{' '.join(missing)} (apt-get install, as root)")
    log(f"[netem-vm] installing {' '.join(missing)} (apt-get)")
    _run(["apt-get", "install", "-y", "-q", "--no-install-recommends", *missing])


def image_package(depends_text: str) -> str:
    """The kernel image package the metapackage depends on, from ``apt-cache depends`` output
    (``  Depends: linux-image-6.1.0-57-amd64``).

    Raises:
        ClusterError: no ``linux-image-*`` dependency in the text.
    """
    for match in re.finditer(r"Depends:\s*<?(linux-image-[0-9][^\s>]*)", depends_text):
        return match.group(1)
    raise ClusterError(f"netem VM: no linux-image package among {KERNEL_METAPACKAGE}'s dependencies: "
                       f"{depends_text.strip()[-300:]!r}")


def unpacked_kernel(root: Path, deb: Path) -> Kernel:
    """The kernel in a folder where `deb` was unpacked (``boot/vmlinuz-V``, ``lib/modules/V``).

    Raises:
        ClusterError: no vmlinuz, or no modules folder of its version.
    """
    images = sorted((root / "boot").glob("vmlinuz-*"))
    if not images:
        raise ClusterError(f"netem VM: no boot/vmlinuz-* in {root} (unpacked from {deb.name})")
    version = images[-1].name[len("vmlinuz-"):]
    modules = root / "lib" / "modules" / version
    if not modules.is_dir():
        raise ClusterError(f"netem VM: no lib/modules/{version} in {root}")
    return Kernel(version, images[-1], modules, deb)


def ensure_kernel(build_dir: Path, log: Callable[[str], None]) -> Kernel:
    """Debian's current kernel under `build_dir` (``linux-image-*.deb`` and its unpacked tree), fetched
    with ``apt-get download`` when no .deb is there yet. Raises ClusterError when apt or dpkg-deb fail."""
    build_dir.mkdir(parents=True, exist_ok=True)
    debs = sorted(build_dir.glob("linux-image-*.deb"))
    if not debs:
        package = image_package(_run(["apt-cache", "depends", KERNEL_METAPACKAGE]))
        log(f"[netem-vm] apt-get download {package} into {build_dir}")
        _run(["apt-get", "download", package], cwd=build_dir)
        debs = sorted(build_dir.glob("linux-image-*.deb"))
        if not debs:
            raise ClusterError(f"netem VM: apt-get download {package} left no .deb in {build_dir}")
    deb = debs[-1]
    root = build_dir / deb.name.removesuffix(".deb")
    if not (root / "boot").is_dir():
        log(f"[netem-vm] unpacking {deb.name}")
        _run(["dpkg-deb", "-x", str(deb), str(root)])
    return unpacked_kernel(root, deb)
