"""Booting the VM: qemu's argv (`qemu_argv`), one boot with a time limit that kills qemu by its own PID
when it runs over (`boot`), and the result the VM left in its results share (`read_result`).

The VM has no network device: its only links are the veth pairs the check makes inside it. Its disks
are two virtio-9p shares (qemu's ``-virtfs``, "local" backend): the host's ``/`` read-only, and a
results folder it can write. ``multidevs=remap`` keeps inode numbers distinct across the host's mounts
under ``/`` (qemu's docs, "-virtfs").
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from harness.errors import ClusterError
from harness.vm.initramfs import EXIT_CODE_FILE, HOST_SHARE_TAG, RESULTS_SHARE_TAG

KERNEL_ARGS = "console=ttyS0 panic=-1 loglevel=4"  # panic=-1 + -no-reboot: an init that dies ends qemu
MEMORY_MIB, CPUS = 1024, 2


@dataclass(frozen=True)
class Boot:
    """How one boot ended: qemu's exit `code` (None when it was killed at the time limit), `timed_out`,
    `elapsed_s` and the console's text (`console`, the serial port's output)."""

    code: int | None
    timed_out: bool
    elapsed_s: float
    console: str


def qemu_argv(vmlinuz: Path, initramfs: Path, results_dir: Path, kvm: bool = True, memory_mib: int = MEMORY_MIB,
              cpus: int = CPUS, host_root: str = "/") -> list[str]:
    """qemu-system-x86_64's argv: KVM (``-enable-kvm -cpu host``; multi-threaded TCG with ``kvm=False``), no display
    (the serial console on stdout), no network device, no reboot, the kernel and initramfs given
    directly, `host_root` shared read-only as `HOST_SHARE_TAG` and `results_dir` writable as
    `RESULTS_SHARE_TAG`."""
    # -arch-capabilities: qemu 7.2 asserts setting MSR 0x10a under a KVM that refuses it (nested, AMD)
    accel = ["-enable-kvm", "-cpu", "host,-arch-capabilities"] if kvm else ["-accel", "tcg,thread=multi", "-cpu", "max"]
    return ["qemu-system-x86_64", *accel, "-m", str(memory_mib), "-smp", str(cpus), "-nographic", "-no-reboot",
            "-nic", "none", "-kernel", str(vmlinuz), "-initrd", str(initramfs), "-append", KERNEL_ARGS,
            "-virtfs", f"local,path={host_root},mount_tag={HOST_SHARE_TAG},security_model=none,readonly=on,"
                       f"multidevs=remap",
            "-virtfs", f"local,path={results_dir},mount_tag={RESULTS_SHARE_TAG},security_model=none,"
                       f"multidevs=remap"]


def boot(argv: Sequence[str], timeout_s: float, console_path: Path, nice: int = 0) -> Boot:
    """Run qemu (`argv`) until it exits or `timeout_s` passes; then SIGTERM its process (its own PID, in
    a session of its own) and SIGKILL it 5 s later. The console goes to `console_path` as it comes.
    `nice`: added to qemu's niceness (its vCPUs share the host with everything else).

    Raises:
        ClusterError: qemu could not start.
    """
    started = time.monotonic()
    with open(console_path, "wb") as console:
        try:
            proc = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=console, stderr=subprocess.STDOUT,
                                    start_new_session=True, preexec_fn=(lambda: os.nice(nice)) if nice else None)
        except OSError as exc:
            raise ClusterError(f"netem VM: {argv[0]} could not start: {exc}") from None
        timed_out = False
        try:
            code: int | None = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out, code = True, None
        finally:
            if proc.poll() is None:  # timed out, or interrupted (Ctrl-C): end qemu, by its PID only
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
    return Boot(code, timed_out, round(time.monotonic() - started, 3),
                console_path.read_text(errors="replace"))


def read_result(results_dir: Path, pattern: str, boot_: Boot) -> tuple[int, dict[str, Any]]:
    """The command's exit code (`EXIT_CODE_FILE`) and the one JSON report matching `pattern` that the
    VM left in `results_dir`.

    Raises:
        ClusterError: the VM timed out, left no exit code or no report (or several), or the report is
        not a JSON object; the message ends with the console's last lines.
    """
    tail = "\n".join(boot_.console.strip().splitlines()[-25:])
    why = f"the VM ran over its {boot_.elapsed_s:g} s" if boot_.timed_out else f"qemu exited {boot_.code}"
    exit_file = results_dir / EXIT_CODE_FILE
    if not exit_file.is_file():
        raise ClusterError(f"netem VM: the check did not finish ({why}); console:\n{tail}")
    try:
        code = int(exit_file.read_text().strip())
    except ValueError:
        raise ClusterError(f"netem VM: {exit_file} is not an exit code: {exit_file.read_text()[:80]!r}") from None
    reports = sorted(results_dir.glob(pattern))
    if len(reports) != 1:
        raise ClusterError(f"netem VM: the check exited {code} and left {len(reports)} reports {pattern} in "
                           f"{results_dir} (expected one); console:\n{tail}")
    try:
        report = json.loads(reports[0].read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ClusterError(f"netem VM: {reports[0]} is not JSON: {exc}") from None
    if not isinstance(report, dict):
        raise ClusterError(f"netem VM: {reports[0]} is not a JSON object")
    return code, report
