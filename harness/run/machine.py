"""`machine_info` and `commit_info` for the top of every report (after pyperf / pytest-benchmark)."""

from __future__ import annotations

import os
import platform
import subprocess
from typing import Any

import psutil

from harness import REPO_ROOT


def machine_info() -> dict[str, Any]:
    """Host facts that change benchmark results: CPU, memory, OS, kernel, Python and library versions."""
    import numpy
    import torch

    vm = psutil.virtual_memory()
    freq = psutil.cpu_freq()
    cpu_model = ""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    cpu_model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {
        "hostname": platform.node(),
        "system": platform.system(),
        "kernel": platform.release(),
        "machine": platform.machine(),
        "cpu_model": cpu_model,
        "cpu_count_logical": psutil.cpu_count(logical=True),
        "cpu_count_physical": psutil.cpu_count(logical=False),
        "cpu_freq_mhz": freq.current if freq else None,
        "memory_total_bytes": vm.total,
        "load_average": list(os.getloadavg()),
        "python_version": platform.python_version(),
        "python_implementation": platform.python_implementation(),
        "torch_version": torch.__version__,
        "numpy_version": numpy.__version__,
        "rmem_max_bytes": _read_int("/proc/sys/net/core/rmem_max"),
        "wmem_max_bytes": _read_int("/proc/sys/net/core/wmem_max"),
    }


def commit_info() -> dict[str, Any]:
    """The git commit the harness ran from, and whether the tree had uncommitted changes."""
    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    status = git("status", "--porcelain")
    return {
        "id": git("rev-parse", "HEAD"),
        "branch": git("rev-parse", "--abbrev-ref", "HEAD"),
        "time": git("log", "-1", "--format=%cI"),
        "dirty": bool(status) if status is not None else None,
    }


def _read_int(path: str) -> int | None:
    try:
        with open(path) as fh:
            return int(fh.read().strip())
    except (OSError, ValueError):
        return None
