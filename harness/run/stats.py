"""Per-container figures from Docker Engine API stats samples, with the formulas of docker's own CLI.

Source: docker/cli ``cli/command/container/stats_helpers.go`` (``calculateCPUPercentUnix``,
``calculateMemUsageUnixNoCache``, ``calculateNetwork``, ``calculateBlockIO``), so the numbers match
``docker stats``.
"""

from __future__ import annotations

from typing import Any

from wiiide.metrics import summarize


def cpu_percent(sample: dict[str, Any]) -> float:
    """CPU % of one host core (100 % = one core fully busy), from a sample and its ``precpu_stats``."""
    cpu, pre = sample.get("cpu_stats") or {}, sample.get("precpu_stats") or {}
    cpu_delta = (cpu.get("cpu_usage", {}).get("total_usage", 0) or 0) - (pre.get("cpu_usage", {}).get("total_usage", 0) or 0)
    system_delta = (cpu.get("system_cpu_usage", 0) or 0) - (pre.get("system_cpu_usage", 0) or 0)
    online = cpu.get("online_cpus") or len(cpu.get("cpu_usage", {}).get("percpu_usage") or []) or 1
    if system_delta > 0 and cpu_delta > 0:
        return cpu_delta / system_delta * online * 100.0
    return 0.0


def memory_bytes(sample: dict[str, Any]) -> int:
    """Memory usage without page cache: usage - total_inactive_file (cgroup v1) or inactive_file (v2)."""
    mem = sample.get("memory_stats") or {}
    usage = mem.get("usage", 0) or 0
    stats = mem.get("stats") or {}
    for key in ("total_inactive_file", "inactive_file"):
        value = stats.get(key)
        if value is not None and value < usage:
            return usage - value
    return usage


def network_bytes(sample: dict[str, Any]) -> tuple[int, int]:
    """(rx_bytes, tx_bytes) summed over the container's interfaces, since it started."""
    rx = tx = 0
    for iface in (sample.get("networks") or {}).values():
        rx += iface.get("rx_bytes", 0) or 0
        tx += iface.get("tx_bytes", 0) or 0
    return rx, tx


def block_io_bytes(sample: dict[str, Any]) -> tuple[int, int]:
    """(read_bytes, write_bytes) from ``blkio_stats.io_service_bytes_recursive``."""
    read = write = 0
    for entry in (sample.get("blkio_stats") or {}).get("io_service_bytes_recursive") or []:
        op = str(entry.get("op", "")).lower()
        if op == "read":
            read += entry.get("value", 0) or 0
        elif op == "write":
            write += entry.get("value", 0) or 0
    return read, write


def parse_sample(sample: dict[str, Any], t_s: float) -> dict[str, Any] | None:
    """One Engine API stats sample -> a flat record; None for the empty sample of a stopped container."""
    if not (sample.get("memory_stats") or {}).get("usage") and not (sample.get("cpu_stats") or {}).get("system_cpu_usage"):
        return None
    rx, tx = network_bytes(sample)
    blk_read, blk_write = block_io_bytes(sample)
    return {
        "t_s": round(t_s, 3),
        "cpu_percent": round(cpu_percent(sample), 3),
        "memory_bytes": memory_bytes(sample),
        "net_rx_bytes": rx,
        "net_tx_bytes": tx,
        "blk_read_bytes": blk_read,
        "blk_write_bytes": blk_write,
    }


def summarize_samples(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """CPU % and memory statistics over a run, and the network/block counters of its last sample."""
    if not samples:
        return {"sample_count": 0}
    last = samples[-1]
    return {
        "sample_count": len(samples),
        "cpu_percent": summarize(s["cpu_percent"] for s in samples[1:] or samples),
        "memory_bytes": summarize(s["memory_bytes"] for s in samples),
        "memory_peak_bytes": max(s["memory_bytes"] for s in samples),
        "net_rx_bytes": last.get("net_rx_bytes"),
        "net_tx_bytes": last.get("net_tx_bytes"),
        "blk_read_bytes": last.get("blk_read_bytes"),
        "blk_write_bytes": last.get("blk_write_bytes"),
    }
