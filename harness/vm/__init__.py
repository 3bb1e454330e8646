"""A KVM virtual machine of Debian's own kernel (which has ``sch_netem``) to run the harness's netem path
on a machine whose kernel lacks it: the kernel and its modules from ``linux-image-amd64``'s .deb
(`harness.vm.kernel`), a small initramfs of busybox and those modules (`harness.vm.initramfs`), and
qemu booting it with the host's root filesystem shared read-only over virtio-9p (`harness.vm.qemu`),
so the VM runs the host's python, tc and iproute2 against its own kernel. docs/links-impairments.md,
"Through netem, in a VM".
"""
