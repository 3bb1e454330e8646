"""Host sysctls for a sweep (net.core.rmem_max/wmem_max): set before the first run, restored afterwards
however the sweep ends. Raises `HarnessError` when they cannot be written (not root).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from harness.errors import HarnessError


def _path(key: str) -> Path:
    return Path("/proc/sys") / key.replace(".", "/")


def read(key: str) -> int:
    """The integer value of sysctl `key` (e.g. ``net.core.rmem_max``) from /proc/sys. Raises OSError."""
    return int(_path(key).read_text().split()[0])


class HostSysctls:
    """Context manager: set the values on entry, restore the old ones on exit."""

    def __init__(self, values: dict[str, int]) -> None:
        self.values = values
        self.previous: dict[str, int] = {}

    def __enter__(self) -> "HostSysctls":
        if self.values and os.geteuid() != 0:
            raise HarnessError(f"host_sysctls {self.values} need root (the kernel's socket buffer caps are "
                               "host-wide); run as root or drop host_sysctls from the spec")
        try:
            for key, value in self.values.items():
                self.previous[key] = read(key)
                _path(key).write_text(f"{value}\n")
        except OSError as exc:
            self.__exit__(None, None, None)
            raise HarnessError(f"cannot set host sysctl {key}={value}: {exc}") from None
        return self

    def __exit__(self, *exc_info: Any) -> None:
        for key, value in self.previous.items():
            try:
                _path(key).write_text(f"{value}\n")
            except OSError:
                pass

    def record(self) -> dict[str, Any]:
        """``{key: {"set": value, "previous": value before}}`` for the report."""
        return {key: {"set": value, "previous": self.previous.get(key)} for key, value in self.values.items()}
