"""Per-container figures from Docker Engine API stats samples, with the formulas of docker's own CLI.

Source: docker/cli ``cli/command/container/stats_helpers.go`` (``calculateCPUPercentUnix``,
``calculateMemUsageUnixNoCache``, ``calculateNetwork``, ``calculateBlockIO``), so the numbers match
``docker stats``.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Iterator, Mapping

from wiiide.metrics import summarize

STATS_INTERVAL_S = 5.0  # seconds between two stats reads of a container during a run
# The first reads come sooner, 1, 2 and 4 s after the container's first (then every STATS_INTERVAL_S):
# a run shorter than one interval still gets a read after its traffic began (a worker of a 4 s run
# read only at 0 s and after it exited showed no bytes at all).
EARLY_READS_S = (1.0, 2.0, 4.0)
STOP_WAIT_S = 5.0  # how long `StatsReader.stop` waits for the last read
CUMULATIVE_KEYS = ("net_rx_bytes", "net_tx_bytes", "blk_read_bytes", "blk_write_bytes")


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


def since_baseline(record: dict[str, Any], baseline: Mapping[str, int] | None) -> dict[str, Any]:
    """`record` (a `parse_sample` record) with its cumulative counters (`CUMULATIVE_KEYS`: bytes
    since the container started) less `baseline`'s: bytes since the baseline was read. A counter
    that went backwards (the container was restarted) is kept as it is. No baseline: unchanged."""
    if not baseline:
        return record
    out = dict(record)
    for key in CUMULATIVE_KEYS:
        before = baseline.get(key)
        if before is not None and out.get(key) is not None and out[key] >= before:
            out[key] = out[key] - before
    return out


class StatsReader:
    """Reads one container's Engine API stats on a daemon thread into parsed samples (`parse_sample`
    records, ``t_s`` seconds after `t0`, a `time.monotonic` instant): at once, then `EARLY_READS_S`
    after that first read (each capped at `interval_s`), then every `interval_s` seconds, and once
    more at `stop`; a one-shot read each time, its CPU % against the previous read (the first's is 0).

    Not ``docker stats``' stream of one sample a second: with five containers on a two-core host the
    streams cost dockerd, containerd and the shims about 45 ms of CPU a second (2 % of the host, taken
    from the run being measured); read every `STATS_INTERVAL_S` they cost a fifth of that.
    """

    def __init__(self, container, t0: float, interval_s: float | None = None) -> None:
        self.container = container
        self.samples: list[dict[str, Any]] = []
        self._t0 = t0
        self._interval_s = STATS_INTERVAL_S if interval_s is None else interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"stats {getattr(container, 'name', '')}", daemon=True)
        self._thread.start()

    def _read(self, previous_cpu: dict | None) -> dict | None:
        """One sample (None: the container cannot be read); its cpu_stats become the next one's precpu."""
        try:
            raw = self.container.client.api.stats(self.container.id, stream=False, one_shot=True)
        except Exception:  # docker.errors.APIError / NotFound, a transport error: the container went away
            return None
        if previous_cpu is not None:
            raw["precpu_stats"] = previous_cpu
        elif not (raw.get("precpu_stats") or {}).get("system_cpu_usage"):  # one-shot: none, not since boot
            raw["precpu_stats"] = raw.get("cpu_stats")
        record = parse_sample(raw, time.monotonic() - self._t0)
        if record is not None:
            self.samples.append(record)
        return raw.get("cpu_stats") or None

    def read_offsets_s(self) -> Iterator[float]:
        """Seconds after the first read at which the next reads are due, without end (`_loop`'s
        schedule): `EARLY_READS_S` while each is at most `interval_s` after the one before, then
        every `interval_s`."""
        t = 0.0
        for early in EARLY_READS_S:
            if early - t > self._interval_s:
                break
            t = early
            yield t
        while True:
            t += self._interval_s
            yield t

    def _loop(self) -> None:
        first = time.monotonic()
        cpu = self._read(None)
        for due_s in self.read_offsets_s():
            if self._stop.wait(max(0.0, first + due_s - time.monotonic())):
                break
            cpu = self._read(cpu)
        self._read(cpu)  # the last sample, at `stop` (a container that has exited gives none)

    def stop(self, wait: bool = True) -> None:
        """Take a last sample and keep none after it; with `wait`, wait for it up to `STOP_WAIT_S`."""
        self._stop.set()
        if wait:
            self._thread.join(timeout=STOP_WAIT_S)


def stop_readers(readers) -> None:
    """`StatsReader.stop` on every reader of `readers` (an iterable), their last reads at once."""
    readers = list(readers)
    for reader in readers:
        reader.stop(wait=False)
    for reader in readers:
        reader.stop()


def start_readers(containers: list, t0: float) -> dict[str, StatsReader]:
    """One `StatsReader` per container, by container name."""
    return {c.name: StatsReader(c, t0) for c in containers}


def read_counters(container) -> dict[str, int] | None:
    """The container's cumulative counters now (`CUMULATIVE_KEYS`), from one Engine API stats call
    (``one-shot``: no wait for a second sample); None when the container cannot be read."""
    try:
        raw = container.client.api.stats(container.id, stream=False, one_shot=True)
    except Exception:  # docker.errors.APIError / NotFound, or an engine without one-shot: no baseline
        return None
    rx, tx = network_bytes(raw)
    blk_read, blk_write = block_io_bytes(raw)
    return {"net_rx_bytes": rx, "net_tx_bytes": tx, "blk_read_bytes": blk_read, "blk_write_bytes": blk_write}


def container_lifetime(container) -> dict[str, str | None]:
    """When the container's main process started and finished (UTC, RFC 3339 as the Engine API gives
    it; None when not yet), from ``State.StartedAt`` / ``State.FinishedAt``."""
    state = container.attrs.get("State") or {}

    def stamp(key: str) -> str | None:
        value = state.get(key)
        return None if not value or value.startswith("0001-") else value

    return {"started_at_utc": stamp("StartedAt"), "finished_at_utc": stamp("FinishedAt")}
