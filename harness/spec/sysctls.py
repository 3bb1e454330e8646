"""Host kernel settings a sweep needs, set for its duration and restored afterwards.

The kernel caps SO_SNDBUF/SO_RCVBUF requests at ``net.core.wmem_max`` / ``rmem_max`` (socket(7)),
and these are not per network namespace: a container cannot raise them (``docker run --sysctl
net.core.rmem_max=...`` is refused). On these machines they are 4 MiB, so requests of 4, 8 and
16 MiB all end up at the same effective 8 MiB. A spec that studies buffer sizes raises them::

    host_sysctls: {net.core.rmem_max: 33554432, net.core.wmem_max: 32MiB}

Only the keys in `ALLOWED` may be set, only as root, and the old values are written back when the
sweep ends, however it ends (harness.run.sysctls). The report records both.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BeforeValidator, TypeAdapter

from harness.spec.base import unit, validate
from wiiide.units import parse_size_bytes

ALLOWED = ("net.core.rmem_max", "net.core.wmem_max")
MIN_VALUE = 4096
MAX_VALUE = 1 << 30


def _bytes(value: Any) -> int:
    return unit(parse_size_bytes, value)


def _in_range(value: int) -> int:
    if not MIN_VALUE <= value <= MAX_VALUE:
        raise ValueError(f"{value!r}; allowed: {MIN_VALUE}..{MAX_VALUE} bytes (4KiB..1GiB)")
    return value


SysctlBytes = Annotated[int, BeforeValidator(_bytes, json_schema_input_type=int | str), AfterValidator(_in_range)]
HostSysctls = dict[Literal[ALLOWED], SysctlBytes]  # type: ignore[valid-type]
"""A spec's ``host_sysctls``: an allowed key -> bytes (4096 .. 1 GiB; ``33554432`` or ``32MiB``)."""

_SYSCTLS = TypeAdapter(HostSysctls)


def parse_sysctls(value: Any, source: str) -> dict[str, int]:
    """Validate a spec's ``host_sysctls`` (None: none). Returns key -> bytes (int).

    Raises:
        SpecError: ``<source>: host_sysctls.<key>: ...`` naming the key and what is allowed.
    """
    if value is None:
        return {}
    return validate(_SYSCTLS, value, source, "host_sysctls")
