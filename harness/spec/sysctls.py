"""Host kernel settings a sweep needs, set for its duration and restored afterwards.

The kernel caps SO_SNDBUF/SO_RCVBUF requests at ``net.core.wmem_max`` / ``rmem_max`` (socket(7)),
and these are not per network namespace: a container cannot raise them (``docker run --sysctl
net.core.rmem_max=...`` is refused). On these machines they are 4 MiB, so requests of 4, 8 and
16 MiB all end up at the same effective 8 MiB. A spec that studies buffer sizes raises them::

    host_sysctls: {net.core.rmem_max: 33554432, net.core.wmem_max: 33554432}

Only the keys in `ALLOWED` may be set, only as root, and the old values are written back when the
sweep ends, however it ends. The report records both.
"""

from __future__ import annotations

from typing import Any

from harness.errors import SpecError

ALLOWED = ("net.core.rmem_max", "net.core.wmem_max")


MAX_VALUE = 1 << 30


def parse_sysctls(value: Any, source: str) -> dict[str, int]:
    """Validate a spec's ``host_sysctls``. Raises SpecError naming the key and what is allowed."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise SpecError(f"{source}: host_sysctls: expected a mapping of {' / '.join(ALLOWED)} to bytes")
    out = {}
    for key, number in value.items():
        if key not in ALLOWED:
            raise SpecError(f"{source}: host_sysctls.{key}: not allowed; allowed: {', '.join(ALLOWED)}")
        if isinstance(number, bool) or not isinstance(number, int) or not 4096 <= number <= MAX_VALUE:
            raise SpecError(f"{source}: host_sysctls.{key}: {number!r}; allowed: an integer 4096..{MAX_VALUE}")
        out[key] = number
    return out
