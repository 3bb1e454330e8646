"""host_sysctls: validated at load time, set for a sweep and restored however it ends."""

from __future__ import annotations

import os

import pytest

from harness.errors import SpecError
from harness.run.sysctls import HostSysctls, read
from harness.spec.points import build_spec
from harness.spec.sysctls import parse_sysctls


def test_only_allowed_keys_and_ranges():
    assert parse_sysctls({"net.core.rmem_max": 8388608}, "s.yaml") == {"net.core.rmem_max": 8388608}
    with pytest.raises(SpecError, match=r"s.yaml: host_sysctls.kernel.panic: not allowed"):
        parse_sysctls({"kernel.panic": 1}, "s.yaml")
    with pytest.raises(SpecError, match=r"host_sysctls.net.core.wmem_max: 'big'"):
        parse_sysctls({"net.core.wmem_max": "big"}, "s.yaml")
    with pytest.raises(SpecError, match="host_sysctls"):
        build_spec({"name": "x", "host_sysctls": {"net.core.rmem_max": 10}}, "x.yaml")


@pytest.mark.skipif(os.geteuid() != 0, reason="changing a host sysctl needs root")
def test_values_are_set_inside_and_restored_after_even_on_error():
    before = read("net.core.rmem_max")
    target = before + 4096
    with pytest.raises(RuntimeError):
        with HostSysctls({"net.core.rmem_max": target}) as sysctls:
            assert read("net.core.rmem_max") == target
            assert sysctls.record() == {"net.core.rmem_max": {"set": target, "previous": before}}
            raise RuntimeError("a sweep that fails")
    assert read("net.core.rmem_max") == before
