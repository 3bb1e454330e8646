"""The netem VM's pure parts: module dependencies read from a module's ELF, the load order, the
initramfs's file list and /init, qemu's argv, reading what the VM left, the namespace pair's commands
and the verb's options (`harness.vm`, `harness.bench.link_vm`, `harness.bench.link_netem`)."""

from __future__ import annotations

import argparse
import json
import struct
import sys
from pathlib import Path

import pytest

from harness.bench import link_netem, link_vm
from harness.bench.link_loss import add_arguments, main_from_args
from harness.errors import ClusterError, SpecError
from harness.vm import initramfs, kernel, qemu


def elf_with_sections(sections: dict[str, bytes]) -> bytes:
    """A minimal ELF64 little-endian file with the given sections (and its section-name table last)."""
    names = b"\0" + b"".join(n.encode() + b"\0" for n in [*sections, ".shstrtab"])
    body, headers, offset = b"", [struct.pack("<IIQQQQIIQQ", 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)], 64
    name_at = 1
    for name, data in [*sections.items(), (".shstrtab", names)]:
        headers.append(struct.pack("<IIQQQQIIQQ", name_at, 1, 0, 0, offset + len(body), len(data), 0, 0, 1, 0))
        name_at += len(name) + 1
        body += data
    shoff = 64 + len(body)
    header = b"\x7fELF" + bytes([2, 1, 1]) + bytes(9)
    header += struct.pack("<HHIQQQIHHHHHH", 1, 62, 1, 0, 0, shoff, 0, 64, 0, 0, 64, len(headers), len(headers) - 1)
    return header + body + b"".join(headers)


def test_a_modules_depends_come_from_its_modinfo_section():
    elf = elf_with_sections({".text": b"\x90" * 8, ".modinfo": b"license=GPL\0depends=9pnet,netfs\0name=9p\0"})
    assert initramfs.module_depends(elf) == ["9pnet", "netfs"]
    assert initramfs.module_depends(elf_with_sections({".modinfo": b"depends=\0name=veth\0"})) == []


def test_a_file_that_is_no_module_is_refused():
    with pytest.raises(ValueError, match="ELF64"):
        initramfs.module_depends(b"#!/bin/sh\n")
    with pytest.raises(ValueError, match="modinfo"):
        initramfs.module_depends(elf_with_sections({".text": b"\x90"}))


def test_module_names_read_dashes_as_underscores():
    assert initramfs.module_name("kernel/net/sched/sch_netem.ko") == "sch_netem"
    assert initramfs.module_name("virtio-pci.ko.xz") == "virtio_pci"
    with pytest.raises(ValueError):
        initramfs.module_name("README")


def test_load_order_puts_each_module_after_what_it_needs_once_and_skips_builtins():
    deps = {"9p": ["9pnet", "netfs"], "9pnet_virtio": ["9pnet", "virtio_ring", "virtio"], "9pnet": [],
            "netfs": ["fscache"], "fscache": [], "virtio_ring": [], "virtio": [], "sch_netem": []}
    order = initramfs.load_order(["9pnet_virtio", "9p", "sch_netem"], deps.__getitem__, builtin=["virtio"])
    assert order == ["9pnet", "virtio_ring", "9pnet_virtio", "fscache", "netfs", "9p", "sch_netem"]


def test_a_dependency_cycle_is_refused():
    with pytest.raises(ClusterError, match="a -> b -> a"):
        initramfs.load_order(["a"], {"a": ["b"], "b": ["a"]}.__getitem__)


def test_kernel_modules_reads_a_package_tree_and_names_a_missing_module(tmp_path):
    sched = tmp_path / "kernel" / "net" / "sched"
    sched.mkdir(parents=True)
    (sched / "sch_netem.ko").write_bytes(elf_with_sections({".modinfo": b"depends=\0"}))
    (sched / "sch_htb.ko").write_bytes(elf_with_sections({".modinfo": b"depends=sch_netem\0"}))
    (tmp_path / "modules.builtin").write_text("kernel/drivers/virtio/virtio.ko\n")
    assert [p.name for p in initramfs.kernel_modules(tmp_path, ["sch_htb", "virtio"])] == ["sch_netem.ko", "sch_htb.ko"]
    with pytest.raises(ClusterError, match="veth is not in"):
        initramfs.kernel_modules(tmp_path, ["veth"])


def test_the_file_list_has_busybox_and_the_modules_in_load_order():
    files = initramfs.file_list(Path("/usr/bin/busybox"), [Path("/k/virtio.ko"), Path("/k/9p.ko")])
    assert files == [("bin/busybox", Path("/usr/bin/busybox")), ("lib/modules/virtio.ko", Path("/k/virtio.ko")),
                     ("lib/modules/9p.ko", Path("/k/9p.ko"))]


def test_init_loads_the_modules_in_order_then_runs_the_command_chrooted_and_powers_off():
    text = initramfs.init_script(["/lib/modules/virtio.ko", "/lib/modules/9p.ko"],
                                 ["/usr/bin/python3", "-m", "harness", "it's"], "/work/build/run-1",
                                 {"PYTHONPATH": "/work/repo"})
    lines = text.splitlines()
    assert lines[0] == "#!/bin/busybox sh" and lines[-1] == "poweroff -f"
    insmods = [line.split()[1] for line in lines if line.startswith("insmod ")]
    assert insmods == ["/lib/modules/virtio.ko", "/lib/modules/9p.ko"]
    host_mount = next(i for i, line in enumerate(lines) if " hostroot /mnt/host" in line)
    assert lines.index(next(line for line in lines if line.startswith("insmod /lib/modules/9p.ko"))) < host_mount
    assert "ro" in lines[host_mount].split(" -o ")[1].split()[0].split(",")
    assert any(line.startswith("mount -t 9p") and "results /mnt/host/work/build/run-1" in line for line in lines)
    chroot = next(line for line in lines if line.startswith("chroot /mnt/host "))
    assert "/usr/bin/env -i" in chroot and "PYTHONPATH=/work/repo" in chroot
    assert chroot.endswith("/usr/bin/python3 -m harness 'it'\"'\"'s'")
    assert any("> /mnt/host/work/build/run-1/exit-code" in line for line in lines)


def test_qemu_argv_shares_the_host_read_only_and_the_results_writable_with_no_network():
    argv = qemu.qemu_argv(Path("/k/vmlinuz"), Path("/b/initramfs.cpio"), Path("/b/run-1"))
    assert argv[:3] == ["qemu-system-x86_64", "-enable-kvm", "-cpu"] and "-nographic" in argv
    assert argv[argv.index("-nic") + 1] == "none" and "-no-reboot" in argv
    assert argv[argv.index("-kernel") + 1] == "/k/vmlinuz" and argv[argv.index("-initrd") + 1] == "/b/initramfs.cpio"
    shares = [argv[i + 1] for i, a in enumerate(argv) if a == "-virtfs"]
    assert shares[0].startswith("local,path=/,mount_tag=hostroot,") and "readonly=on" in shares[0]
    assert shares[1].startswith("local,path=/b/run-1,mount_tag=results,") and "readonly" not in shares[1]
    tcg = qemu.qemu_argv(Path("/k/vmlinuz"), Path("/b/i.cpio"), Path("/b/r"), kvm=False)
    assert "-enable-kvm" not in tcg and tcg[tcg.index("-accel") + 1].startswith("tcg")


def _boot(**kw) -> qemu.Boot:
    return qemu.Boot(**{"code": 0, "timed_out": False, "elapsed_s": 12.0, "console": "a\nlast line", **kw})


def test_read_result_gives_the_exit_code_and_the_one_report(tmp_path):
    (tmp_path / "exit-code").write_text("0\n")
    (tmp_path / "bench-link-netem-1.json").write_text(json.dumps({"all_ok": True}))
    assert qemu.read_result(tmp_path, "bench-link-netem-*.json", _boot()) == (0, {"all_ok": True})


def test_read_result_says_why_nothing_came_back_with_the_console(tmp_path):
    with pytest.raises(ClusterError, match="(?s)ran over its 600 s.*last line"):
        qemu.read_result(tmp_path, "x-*.json", _boot(code=None, timed_out=True, elapsed_s=600.0))
    (tmp_path / "exit-code").write_text("1")
    with pytest.raises(ClusterError, match="exited 1 and left 0 reports"):
        qemu.read_result(tmp_path, "x-*.json", _boot())
    (tmp_path / "x-1.json").write_text("[1]")
    with pytest.raises(ClusterError, match="not a JSON object"):
        qemu.read_result(tmp_path, "x-*.json", _boot())
    (tmp_path / "x-1.json").write_text("{")
    with pytest.raises(ClusterError, match="not JSON"):
        qemu.read_result(tmp_path, "x-*.json", _boot())


def test_the_kernel_package_is_read_from_apt_cache_depends():
    assert kernel.image_package("linux-image-amd64\n  Depends: linux-image-6.1.0-57-amd64\n") == "linux-image-6.1.0-57-amd64"
    with pytest.raises(ClusterError, match="no linux-image"):
        kernel.image_package("linux-image-amd64\n")


def test_the_vm_runs_this_interpreter_on_this_checkout_with_the_checks_options():
    argv = link_vm.check_argv(["--measure", "delay"], Path("/b/run-1"), python="/usr/bin/python3")
    assert argv == ["/usr/bin/python3", "-m", "harness.bench.link_loss", "--netns", "--measure", "delay",
                    "--results-dir", "/b/run-1"]
    assert link_vm.check_env(Path("/repo"))["PYTHONPATH"] == "/repo"


def test_the_pair_is_two_namespaces_whose_veth_ends_are_eth0():
    commands = link_netem.pair_commands(("a", "b"), ("10.0.0.1", "10.0.0.2"))
    assert ["ip", "netns", "add", "a"] in commands and ["ip", "netns", "add", "b"] in commands
    assert ["ip", "-n", "a", "addr", "add", "10.0.0.1/24", "dev", "eth0"] in commands
    assert ["ip", "-n", "b", "addr", "add", "10.0.0.2/24", "dev", "eth0"] in commands
    renamed = [c for c in commands if c[-2:] == ["name", "eth0"]]
    assert [c[2] for c in renamed] == ["a", "b"]


def test_a_namespace_runs_python_as_this_interpreter():
    assert link_netem.NetnsPeer("ns1").argv(["python", "-c", "x"]) == ["ip", "netns", "exec", "ns1", sys.executable,
                                                                      "-S", "-c", "x"]


def test_loss_target_is_fifteen_percent_relative():
    assert link_netem.loss_within_target(1.14, 1.0) and not link_netem.loss_within_target(1.16, 1.0)
    assert link_netem.loss_within_target(0.086, 0.1) and not link_netem.loss_within_target(0.084, 0.1)


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize("argv, needle", [
    (("--vm", "--measure", "capacity"), "--measure"), (("--netns", "--measure", "rate,jitter"), "--measure"),
    (("--measure", "rate"), "--measure"), (("--vm", "--netns"), "--vm"), (("--vm", "--vm-timeout", "0"), "--vm"),
    (("--vm", "--rate", "100"), "--rate"), (("--netns", "--rate", ""), "--rate"),
])
def test_bad_netem_options_fail_before_anything_starts(argv, needle, tmp_path):
    with pytest.raises(SpecError, match=needle):
        main_from_args(_args(*argv, "--results-dir", str(tmp_path)), progress=lambda _: None)


def test_auto_takes_kvm_from_hardware_and_tcg_where_only_pvm_serves_dev_kvm():
    assert link_vm.choose_accelerator("auto", "", ["kvm_amd"])[0] == "kvm"
    accel, why = link_vm.choose_accelerator("auto", "", ["kvm_pvm"])
    assert accel == "tcg" and "kvm_pvm" in why
    assert link_vm.choose_accelerator("auto", "/dev/kvm: No such file or directory", []) == (
        "tcg", "KVM unusable: /dev/kvm: No such file or directory")
    assert link_vm.choose_accelerator("kvm", "", ["kvm_pvm"])[0] == "kvm"
    assert link_vm.choose_accelerator("tcg", "", ["kvm_intel"])[0] == "tcg"
    with pytest.raises(ClusterError, match="--accel tcg"):
        link_vm.choose_accelerator("kvm", "/dev/kvm: Permission denied", ["kvm_intel"])
