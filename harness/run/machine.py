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
    try:
        with open("/proc/cpuinfo") as fh:
            cpu = cpu_identity(fh.read())
    except OSError:
        cpu = cpu_identity("")
    return {
        "hostname": platform.node(),
        "system": platform.system(),
        "kernel": platform.release(),
        "machine": platform.machine(),
        "cpu_model": cpu["model_name"],
        "cpu_signature": cpu["signature"],
        "cpu_vector_flags": cpu["vector_flags"],
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


_VECTOR_FLAG_PREFIXES = ("sse4", "avx", "fma", "f16c", "amx")


def cpu_identity(cpuinfo: str) -> dict[str, Any]:
    """The first processor of a ``/proc/cpuinfo`` text, as the report records it.

    Returns ``model_name`` (``"model name"``, e.g. ``"AMD EPYC"``, which a hypervisor may shorten so
    far that two generations read alike), ``signature`` (``"<vendor_id> family F model M stepping S"``,
    the CPUID numbers that tell them apart; None when the text has none) and ``vector_flags`` (the
    SSE4/AVX/AVX-512/FMA/F16C/AMX flags, sorted: what sets the float32 rate torch's kernels reach).
    Keys absent from the text give ``""``, None and ``[]``; nothing is raised.
    """
    first: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        if not line.strip():
            if first:
                break
            continue
        key, sep, value = line.partition(":")
        if sep:
            first.setdefault(key.strip(), value.strip())
    numbers = [first.get(k) for k in ("cpu family", "model", "stepping")]
    signature = None
    if first.get("vendor_id") and all(numbers):
        signature = "{} family {} model {} stepping {}".format(first["vendor_id"], *numbers)
    flags = first.get("flags", "").split()
    return {
        "model_name": first.get("model name", ""),
        "signature": signature,
        "vector_flags": sorted(f for f in flags if f.startswith(_VECTOR_FLAG_PREFIXES)),
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
