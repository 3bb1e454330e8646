"""The VM's initramfs: busybox (static), the kernel modules the check needs from the kernel's .deb in
load order, and an ``/init`` script that loads them with ``insmod``, mounts the host's root filesystem
(virtio-9p, read-only) and a writable results share, chroots into the host's tree to run one command,
records its exit code beside its results and powers the VM off.

The .deb carries no ``modules.dep`` (``depmod`` runs when the package is installed), so the load order
comes from each module's own ``depends=`` field, read from its ELF ``.modinfo`` section
(`module_depends`), as ``modinfo -F depends`` prints it. The archive is written by GNU cpio in the
kernel's ``newc`` format (Documentation/filesystems/ramfs-rootfs-initramfs.rst) from a staging folder.
"""

from __future__ import annotations

import shlex
import shutil
import struct
import subprocess
from pathlib import Path
from typing import Callable, Mapping, Sequence

from harness.errors import ClusterError

# What the check needs that Debian's kernel builds as modules: virtio-pci and 9p for the shares, veth
# for the pair, and the qdiscs and actions the harness's builders use (netem, htb, tbf, ingress + ifb +
# u32 + mirred). Their dependencies (virtio_ring, 9pnet, netfs, ...) are added by `load_order`.
WANTED_MODULES = ("virtio_pci", "9pnet_virtio", "9p", "veth", "sch_netem", "sch_htb", "sch_tbf", "sch_ingress",
                  "ifb", "cls_u32", "act_mirred")
HOST_SHARE_TAG, RESULTS_SHARE_TAG = "hostroot", "results"
HOST_MOUNT = "/mnt/host"  # where the host's root is mounted in the VM, before the chroot
EXIT_CODE_FILE = "exit-code"  # in the results share: the command's exit status, written after it ends
NINEP_OPTIONS = "trans=virtio,version=9p2000.L,msize=512000"
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def module_name(path: Path | str) -> str:
    """A module's name from its file (``sch_netem.ko`` -> ``sch_netem``; dashes read as underscores, as
    the kernel does)."""
    name = Path(path).name
    for suffix in (".ko.xz", ".ko.zst", ".ko.gz", ".ko"):
        if name.endswith(suffix):
            return name[:-len(suffix)].replace("-", "_")
    raise ValueError(f"not a kernel module file: {name}")


def module_depends(elf: bytes) -> list[str]:
    """The ``depends=`` of a module's ``.modinfo`` section (an ELF64 little-endian relocatable, as
    amd64's modules are): the modules it needs, [] when it needs none.

    Raises:
        ValueError: not an ELF64 little-endian file, or no ``.modinfo`` section.
    """
    if elf[:4] != b"\x7fELF" or elf[4] != 2 or elf[5] != 1:
        raise ValueError("not an ELF64 little-endian file")
    shoff, = struct.unpack_from("<Q", elf, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", elf, 0x3A)

    def section(i: int) -> tuple[int, int, int]:  # (name offset, file offset, size)
        base = shoff + i * shentsize
        name, = struct.unpack_from("<I", elf, base)
        offset, size = struct.unpack_from("<QQ", elf, base + 0x18)
        return name, offset, size

    _, str_offset, str_size = section(shstrndx)
    names = elf[str_offset:str_offset + str_size]
    for i in range(shnum):
        name, offset, size = section(i)
        if names[name:names.index(b"\0", name)] == b".modinfo":
            for field in elf[offset:offset + size].split(b"\0"):
                if field.startswith(b"depends="):
                    return [d for d in field[len(b"depends="):].decode().split(",") if d]
            return []
    raise ValueError("no .modinfo section")


def module_index(modules_dir: Path) -> dict[str, Path]:
    """Every module file under `modules_dir` (``lib/modules/<version>``) by its name (`module_name`)."""
    return {module_name(p): p for p in sorted(modules_dir.rglob("*.ko*"))}


def load_order(wanted: Sequence[str], depends_of: Callable[[str], Sequence[str]],
               builtin: Sequence[str] = ()) -> list[str]:
    """`wanted` and everything they depend on (`depends_of(name)`), each after its dependencies, each
    once; names in `builtin` (``modules.builtin``) are left out, as the kernel has them already.

    Raises:
        ClusterError: a dependency cycle (a broken package).
    """
    order: list[str] = []
    visiting: list[str] = []
    skip = set(builtin)

    def visit(name: str) -> None:
        if name in order or name in skip:
            return
        if name in visiting:
            raise ClusterError(f"netem VM: modules depend on each other in a cycle: {' -> '.join(visiting + [name])}")
        visiting.append(name)
        for dep in depends_of(name):
            visit(dep)
        visiting.pop()
        order.append(name)

    for name in wanted:
        visit(name)
    return order


def builtin_modules(modules_dir: Path) -> list[str]:
    """The names in ``modules.builtin`` (``kernel/fs/x.ko`` lines), [] without that file."""
    path = modules_dir / "modules.builtin"
    return [module_name(line) for line in path.read_text().split()] if path.is_file() else []


def kernel_modules(modules_dir: Path, wanted: Sequence[str] = WANTED_MODULES) -> list[Path]:
    """The module files to load, in load order (`load_order` of `wanted`, dependencies read from each
    file's ``.modinfo``).

    Raises:
        ClusterError: a wanted module or a dependency is neither in the package nor built in.
    """
    index = module_index(modules_dir)

    def depends_of(name: str) -> list[str]:
        if name not in index:
            raise ClusterError(f"netem VM: module {name} is not in {modules_dir} (nor built in)")
        return module_depends(index[name].read_bytes())

    return [index[name] for name in load_order(wanted, depends_of, builtin_modules(modules_dir))]


def init_script(modules: Sequence[str], argv: Sequence[str], results_dir: str,
                env: Mapping[str, str] | None = None) -> str:
    """The VM's ``/init`` (busybox sh): mount proc, sys and devtmpfs and take /dev/console for output,
    ``insmod`` each of `modules` (initramfs paths, in order), mount the host's root read-only at
    `HOST_MOUNT` and the results share at `results_dir` (a host path that exists) inside it, give the
    tree its own proc, sys, dev, tmp and run, then run `argv` chrooted there with only `env` (and
    `PATH`), write its exit code to `EXIT_CODE_FILE` in the results share and power off."""
    q = shlex.quote
    host_results = f"{HOST_MOUNT}{results_dir}"
    env_words = " ".join(q(f"{k}={v}") for k, v in {"PATH": PATH, "HOME": "/tmp", **(env or {})}.items())
    lines = [
        "#!/bin/busybox sh",
        "/bin/busybox --install -s /bin",
        "mkdir -p /proc /sys /dev /tmp && mount -t proc proc /proc && mount -t sysfs sys /sys",
        "mount -t devtmpfs dev /dev",
        "exec </dev/console >/dev/console 2>&1",
        "echo '[netem-vm] kernel' \"$(uname -r)\"",
        *[f"insmod {q(m)} || echo '[netem-vm] insmod {m} failed'" for m in modules],
        f"mkdir -p {HOST_MOUNT}",
        f"mount -t 9p -o {NINEP_OPTIONS},ro,cache=loose {HOST_SHARE_TAG} {HOST_MOUNT} || poweroff -f",
        f"mount -t 9p -o {NINEP_OPTIONS} {RESULTS_SHARE_TAG} {q(host_results)} || poweroff -f",
        f"mount -t proc proc {HOST_MOUNT}/proc && mount -t sysfs sys {HOST_MOUNT}/sys",
        f"mount -t devtmpfs dev {HOST_MOUNT}/dev && mkdir -p {HOST_MOUNT}/dev/shm {HOST_MOUNT}/dev/pts",
        f"mount -t tmpfs tmp {HOST_MOUNT}/dev/shm && mount -t tmpfs tmp {HOST_MOUNT}/tmp",
        f"mount -t tmpfs run {HOST_MOUNT}/run",
        "echo \"[netem-vm] shares mounted at $(cut -d' ' -f1 /proc/uptime) s\"",
        "ip link set lo up",
        f"chroot {HOST_MOUNT} /usr/bin/env -i {env_words} {' '.join(q(a) for a in argv)}",
        f"code=$?; echo $code > {q(host_results + '/' + EXIT_CODE_FILE)}",
        "echo \"[netem-vm] the check exited $code at $(cut -d' ' -f1 /proc/uptime) s\"",
        f"sync; umount {q(host_results)}",
        "poweroff -f",
    ]
    return "\n".join(lines) + "\n"


def file_list(busybox: Path, modules: Sequence[Path]) -> list[tuple[str, Path]]:
    """What goes into the archive beside ``/init``: ``(path in the initramfs, host file)`` pairs:
    busybox as ``/bin/busybox`` and each module as ``/lib/modules/<file name>``, in load order."""
    return [("bin/busybox", busybox), *[(f"lib/modules/{m.name}", m) for m in modules]]


def build_initramfs(stage: Path, out: Path, files: Sequence[tuple[str, Path]], init_text: str) -> Path:
    """Copy `files` and ``/init`` (`init_text`, mode 755) into a fresh `stage` folder and write it as a
    newc cpio archive to `out` (GNU cpio, owner root). Returns `out`.

    Raises:
        ClusterError: cpio is missing or failed.
    """
    if stage.exists():
        shutil.rmtree(stage)
    for rel, src in files:
        dest = stage / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dest)
    (stage / "init").write_text(init_text)
    (stage / "init").chmod(0o755)
    names = sorted(str(p.relative_to(stage)) for p in stage.rglob("*"))
    with open(out, "wb") as fh:
        try:
            done = subprocess.run(["cpio", "--quiet", "-o", "-H", "newc", "-R", "0:0", "--null"], cwd=stage,
                                  input="\0".join(names).encode() + b"\0", stdout=fh, stderr=subprocess.PIPE,
                                  timeout=120, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise ClusterError(f"netem VM: cpio could not run: {exc}") from None
    if done.returncode != 0:
        raise ClusterError(f"netem VM: cpio failed: {done.stderr.decode(errors='replace')[-300:]}")
    return out
