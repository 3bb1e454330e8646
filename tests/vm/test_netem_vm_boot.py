"""Boots the netem VM (`harness.bench.link_vm`) for one short check: Debian's kernel loads netem, the
harness's own commands shape the namespace pair with it, and its read-back and the probes show it
acting. Marker `vm`: it runs where KVM boots a stock kernel, qemu, busybox-static and cpio are installed
and the harness is root, and skips with the reason elsewhere (under TCG a boot takes minutes: see
docs/links-impairments.md, "Through netem")."""

from __future__ import annotations

import json
import os

import pytest

from harness.bench import link_vm
from harness.vm import kernel


def _skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "the VM's host share and the namespaces need root"
    missing = kernel.missing_tools()
    if missing:
        return f"missing {', '.join(missing.values())} (Debian: apt-get install {' '.join(missing)})"
    accel, why = link_vm.choose_accelerator("auto", link_vm.kvm_usable()[1], link_vm.loaded_kvm_modules())
    return None if accel == "kvm" else f"no KVM that boots a stock kernel here: {why}"


pytestmark = [pytest.mark.vm, pytest.mark.skipif(_skip_reason() is not None, reason=str(_skip_reason()))]


def test_netem_shapes_the_pair_inside_a_vm_of_debians_kernel(tmp_path):
    options = ["--measure", "delay,loss", "--delay", "20", "--round-trips", "20", "--loss", "5",
               "--datagrams", "2000"]
    path = link_vm.run_vm(options, tmp_path, progress=lambda _: None, timeout_s=50, accel_asked="kvm")
    report = json.loads(path.read_text())
    check = report["check"]
    assert report["vm"]["check_exit_code"] == 0 and report["vm"]["accelerator"] == "kvm"
    assert check["kernel"]["kernel"] == report["vm"]["kernel_version"] and check["capabilities"]["netem"]
    delay = check["delay_trials"][0]
    assert all(rec["kind"] == "netem" and rec["delay_ms"] == 10.0 for rec in delay["netem_read_back"].values())
    assert delay["median_rtt_ms"] >= 20.0  # each direction held 10 ms at least
    loss = check["loss_trials"][0]
    assert loss["mechanisms"]["loss"] == "netem" and 0 < loss["dropped_packets"] < loss["sent_datagrams"]
    assert loss["received_datagrams"] < loss["sent_datagrams"]
