"""``bench-link --vm``: the netem fidelity check (`harness.bench.link_netem`, ``bench-link --netns``) in
a KVM virtual machine of Debian's own kernel, for machines whose kernel has no ``sch_netem``.

The host tools (`harness.vm.kernel.HOST_PACKAGES`) are installed with apt-get when missing, Debian's
kernel package is fetched into ``build/netem-vm/`` (`harness.vm.kernel.ensure_kernel`), an initramfs is
built of busybox and the kernel's modules (`harness.vm.initramfs`), and qemu boots it
(`harness.vm.qemu`) with the host's ``/`` shared read-only: the VM runs this checkout's harness with the
host's python, tc and iproute2 against its own kernel, writes the check's JSON into a results share
and powers off. qemu is killed (its own PID) past ``--vm-timeout``. The host then writes
``bench-link-vm-<stamp>.json``: the check's report as the VM wrote it (``check``), how the VM ran
(``vm``: kernel, qemu argv, accelerator, boot time, exit code, console log) and the host's
`machine_info` and `commit_info`.
"""

from __future__ import annotations

import os
import shlex
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Sequence

REPORT_NAME = "bench-link-vm"
CHECK_PATTERN = "bench-link-netem-*.json"


def check_argv(options: Sequence[str], results_dir: Path, python: str = sys.executable) -> list[str]:
    """The command the VM runs in the host's tree: this interpreter, ``bench-link --netns`` through its
    lean entry (``-m harness.bench.link_loss``: the CLI's other imports take minutes under emulation),
    `options` (the check's own, e.g. ``--measure loss,delay``) and ``--results-dir`` the share."""
    return [python, "-m", "harness.bench.link_loss", "--netns", *options, "--results-dir", str(results_dir)]


def check_env(repo_root: Path) -> dict[str, str]:
    """The check's environment in the VM: this checkout first on the path, no bytecode written (the
    host's tree is read-only there), unbuffered output (the console shows progress as it comes)."""
    return {"PYTHONPATH": str(repo_root), "PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1"}


def kvm_usable() -> tuple[bool, str]:
    """Whether /dev/kvm can be opened for reading and writing, and why not ("" when it can). Raises
    nothing."""
    try:
        fd = os.open("/dev/kvm", os.O_RDWR)
    except OSError as exc:
        return False, f"/dev/kvm: {exc.strerror}"
    os.close(fd)
    return True, ""


def choose_accelerator(asked: str, kvm_problem: str, kvm_modules: Sequence[str]) -> tuple[str, str]:
    """``kvm`` or ``tcg`` for `asked` (``auto``, ``kvm`` or ``tcg``), with why: ``auto`` takes KVM when
    /dev/kvm opens (`kvm_problem` empty) and is served by ``kvm_intel`` or ``kvm_amd`` (of the loaded
    `kvm_modules`); a KVM served only by ``kvm_pvm`` (PVM, which runs guest kernels built for it) does
    not boot Debian's kernel: it stops right after decompressing it, so auto takes TCG there.

    Raises:
        ClusterError: ``kvm`` asked and /dev/kvm does not open.
    """
    from harness.errors import ClusterError

    hardware = [m for m in kvm_modules if m in ("kvm_intel", "kvm_amd")]
    if asked == "tcg":
        return "tcg", "asked (--accel tcg)"
    if kvm_problem:
        if asked == "kvm":
            raise ClusterError(f"netem VM: KVM is unusable here ({kvm_problem}); --accel tcg emulates instead")
        return "tcg", f"KVM unusable: {kvm_problem}"
    if asked == "kvm" or hardware:
        return "kvm", "asked (--accel kvm)" if asked == "kvm" else f"/dev/kvm by {hardware[0]}"
    if "kvm_pvm" in kvm_modules:
        return "tcg", ("/dev/kvm is served by kvm_pvm only, which does not boot a stock kernel (it stops after "
                       "decompressing it)")
    return "kvm", "/dev/kvm opens"


def loaded_kvm_modules() -> list[str]:
    """The KVM modules loaded here (``/sys/module/kvm_*``). Raises nothing."""
    return sorted(p.name for p in Path("/sys/module").glob("kvm_*"))


def run_vm(options: Sequence[str], results_dir: Path, progress: Callable[[str], None], timeout_s: float = 600.0,
           accel_asked: str = "auto", build_dir: Path | None = None) -> Path:
    """Boot the VM once to run ``bench-link --netns`` with `options`; write the host's report to
    `results_dir` and return its path (the check's own exit code and ``all_ok`` are in it).

    Raises:
        ClusterError: a tool or the kernel cannot be had, KVM is asked and unusable, or the VM
        left no report (timed out, or the check failed before writing it; the console's tail is in
        the message).
    """
    from harness import REPO_ROOT
    from harness.errors import ClusterError
    from harness.run.machine import commit_info, machine_info
    from harness.vm import initramfs, kernel, qemu
    from wiiide.metrics import write_json_atomic

    accel, accel_why = choose_accelerator(accel_asked, kvm_usable()[1], loaded_kvm_modules())
    kvm = accel == "kvm"
    build = build_dir or REPO_ROOT / "build" / "netem-vm"
    kernel.ensure_host_packages(progress)
    kern = kernel.ensure_kernel(build, progress)
    modules = initramfs.kernel_modules(kern.modules_dir)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    share = build / f"run-{stamp}"
    share.mkdir(parents=True)
    argv = check_argv(options, share)
    init = initramfs.init_script([f"/lib/modules/{m.name}" for m in modules], argv, str(share),
                                 check_env(REPO_ROOT))
    image = initramfs.build_initramfs(build / "initramfs", build / f"initramfs-{kern.version}.cpio",
                                      initramfs.file_list(Path(os.path.realpath(_which("busybox"))), modules), init)
    qemu_argv = qemu.qemu_argv(kern.vmlinuz, image, share, kvm=kvm)
    progress(f"[netem-vm] booting Debian's {kern.version} ({accel.upper()}: {accel_why}), "
             f"time limit {timeout_s:g} s: {shlex.join(qemu_argv)}")
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    boot = qemu.boot(qemu_argv, timeout_s, share / "console.log")
    code, check = qemu.read_result(share, CHECK_PATTERN, boot)
    for line in boot.console.splitlines():
        if line.startswith("[bench-link]") or line.startswith("[netem-vm]"):
            progress(line)
    report: dict[str, Any] = {
        "name": REPORT_NAME, "created_at_utc": started,
        "finished_at_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine_info": machine_info(), "commit_info": commit_info(),
        "vm": {"kernel_version": kern.version, "kernel_deb": kern.deb.name, "accelerator": accel,
               "accelerator_reason": accel_why,
               "qemu_argv": qemu_argv, "check_argv": argv, "modules": [initramfs.module_name(m) for m in modules],
               "boot_elapsed_s": boot.elapsed_s, "qemu_exit_code": boot.code, "check_exit_code": code,
               "console_log": str(share / "console.log")},
        "check": check, "all_ok": bool(check.get("all_ok")) and code == 0}
    if code != 0:
        raise ClusterError(f"netem VM: the check exited {code}; console: {share / 'console.log'}")
    path = results_dir / f"{REPORT_NAME}-{stamp}.json"
    write_json_atomic(path, report)
    return path


def _which(tool: str) -> str:
    import shutil

    from harness.errors import ClusterError

    found = shutil.which(tool)
    if found is None:
        raise ClusterError(f"netem VM: {tool} is not on PATH")
    return found
