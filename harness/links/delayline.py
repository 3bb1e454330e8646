"""The delay line's commands and its own account, pure: how the harness starts, waits for, stops and
probes ``wiiide-delayline`` (docker/delayline/wiiide-delayline.c, built into the node image) inside a
container, and what its stats file says.

The delay line is an NFQUEUE consumer in the container's own network namespace. The fallback's chain
(`harness.links.fallback.rule_commands`) queues the packets the container receives with
``--queue-bypass``, so they pass undelayed whenever no consumer is bound (it was never started, it
died, it was stopped): a dead delay line does not blackhole the container. Its life with the point:

1. start: `start_argv` (`harness.links.fallback.delay_line_argv`) runs *detached* (an Engine API exec
   that stays as the exec's own process, reaped by the engine when it ends; `runs_in_background`
   tells the runner so), then `wait_ready_argv` waits until it has bound its queue, or prints why it
   could not (its error file), exit status 1;
2. run: it rewrites `STATS_FILE` (JSON, `parse_stats`) every 250 ms: packets queued, accepted and
   held, the most held at once, its lateness (verdict time minus due time) and its CPU seconds;
3. stop: `stop_argv` sends SIGTERM (SIGKILL after 5 s), which accepts every packet still held, unbinds
   the queue and removes the pid file; a container that exits takes it along.

Nothing here runs a command. Raises nothing unless a function says so.
"""

from __future__ import annotations

import json
from typing import Any

DELAY_LINE = "wiiide-delayline"  # the consumer's binary in the node image (/usr/local/bin)
STATS_FILE = "/tmp/wiiide-delayline.json"  # queue 0's, inside the container; rewritten every 250 ms and at exit
READY_TIMEOUT_S = 5.0

# the stats file's keys and their types; a file missing one, or with another type, is refused
_STATS_KEYS: dict[str, type | tuple[type, ...]] = {
    "pid": int, "running": bool, "realtime": bool, "nice": int, "slice_us": int, "queue": int, "delay_us": int, "jitter_us": int,
    "distribution": str, "draws": int, "max_len_packets": int, "queued_packets": int, "accepted_packets": int,
    "held_packets": int, "max_held_packets": int, "dropped_full_packets": int, "kernel_queue_dropped_packets": int,
    "kernel_user_dropped_packets": int, "late_mean_us": (int, float), "late_max_us": (int, float),
    "late_p99_us": (int, float), "stamped_packets": int, "read_wait_mean_us": (int, float),
    "read_wait_max_us": (int, float), "early_max_us": (int, float), "wake_lead_us": (int, float),
    "cpu_user_s": (int, float), "cpu_system_s": (int, float),
    "reorder_pct": (int, float), "reorder_corr_pct": (int, float), "gap": int, "reordered_packets": int,
    "gemodel": bool, "ge_p_pct": (int, float), "ge_r_pct": (int, float), "ge_1h_pct": (int, float),
    "ge_1k_pct": (int, float), "loss_pct": (int, float), "loss_corr_pct": (int, float),
    "duplicate_pct": (int, float), "duplicate_corr_pct": (int, float), "duplicated_packets": int,
    "loss_dropped_packets": int, "loss_bursts": int, "ge_bad_entries": int}


def stats_file(queue_num: int = 0) -> str:
    """The stats file of the delay line bound to `queue_num` (inside the container): `STATS_FILE` for
    queue 0, ``/tmp/wiiide-delayline-N.json`` for queue N (one instance per queue, a pair's link each)."""
    return STATS_FILE if queue_num == 0 else f"/tmp/wiiide-delayline-{queue_num}.json"


def runs_in_background(argv: list[str] | tuple[str, ...]) -> bool:
    """Whether `argv` is the delay line's own run (started detached, see the module docstring), not one
    of its short commands (``--wait-ready``, ``--stop``, ``--check``)."""
    return len(argv) > 1 and argv[0] == DELAY_LINE and argv[1] == "--queue"


def wait_ready_argv(timeout_s: float = READY_TIMEOUT_S, queue_num: int = 0) -> list[str]:
    """Wait (up to `timeout_s`) until the delay line started on `queue_num` has bound it; exits 1 with
    its error."""
    return [DELAY_LINE, "--wait-ready", "--timeout-s", f"{timeout_s:g}", *(["--queue", str(queue_num)] if queue_num else [])]


def stop_argv(queue_num: int = 0) -> list[str]:
    """Stop the delay line running on `queue_num` (nothing running is fine: exit 0)."""
    return [DELAY_LINE, "--stop", *(["--queue", str(queue_num)] if queue_num else [])]


def check_argv(queue_num: int = 0) -> list[str]:
    """The probe's check: bind queue `queue_num` once and unbind it (the kernel's nfnetlink_queue and
    the binary with its library are there)."""
    return [DELAY_LINE, "--check", "--queue", str(queue_num)]


def stats_command(path: str = STATS_FILE) -> list[str]:
    """The read-back of the delay line's stats: ``cat`` of its stats file (`path`: as the runner sees it)."""
    return ["cat", path]


def parse_stats(text: str) -> dict[str, Any]:
    """The delay line's stats file -> its record, with ``cpu_s`` (user + system seconds) added: ``pid``,
    ``running``, ``realtime`` (SCHED_FIFO granted), ``nice``, ``slice_us`` (its EEVDF slice where it
    was set, else 0), ``delay_us``, ``jitter_us``, ``distribution``,
    ``draws``, packet counts (``queued_packets``, ``accepted_packets``, ``held_packets``,
    ``max_held_packets``, ``dropped_full_packets``; the kernel queue's own ``kernel_queue_dropped_packets``
    and ``kernel_user_dropped_packets``), lateness ``late_mean_us`` (the mean of verdict minus due time),
    ``late_max_us`` and ``early_max_us`` (the latest verdict after and the earliest before its due time;
    the delay line accepts none early, so 0), ``late_p99_us`` (the 99th percentile of the lateness, to
    its 10 us bucket's upper edge), ``stamped_packets`` (timed from the kernel's arrival stamp rather than
    from their read; see docker/delayline/wiiide-delayline.c), ``read_wait_mean_us`` and
    ``read_wait_max_us`` (how long those waited in the kernel's queue to be read), ``wake_lead_us``
    (how much earlier the delay line ends a long sleep: its running estimate of its wake-ups' lateness;
    all microseconds) and
    ``cpu_user_s``/``cpu_system_s``; netem's reorder (``reorder_pct``,
    ``reorder_corr_pct``, ``gap``, ``reordered_packets``: accepted at once), Gilbert-Elliott loss
    (``gemodel``, ``ge_p_pct`` .. ``ge_1k_pct``, ``ge_bad_entries``: good -> bad transitions) or netem's
    correlated random loss (``loss_pct``, ``loss_corr_pct``; 0 when not drawn here), and the loss either
    drew (``loss_dropped_packets``, ``loss_bursts``: runs of lost packets); a correlated duplicate
    (``duplicate_pct``, ``duplicate_corr_pct``; ``duplicated_packets``: accepted with the mark the TEE rule
    clones).

    Raises:
        ValueError: not a JSON object, a key missing or of another type.
    """
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"the delay line's stats are not JSON ({exc}): {text[:120]!r}") from None
    if not isinstance(data, dict):
        raise ValueError(f"the delay line's stats are a {type(data).__name__}, not an object")
    for key, kind in _STATS_KEYS.items():
        value = data.get(key)
        if value is None or (isinstance(value, bool) and kind is not bool) or not isinstance(value, kind):
            raise ValueError(f"the delay line's stats: {key} is {value!r}")
    record = {key: data[key] for key in _STATS_KEYS}
    record["cpu_s"] = round(record["cpu_user_s"] + record["cpu_system_s"], 6)
    return record
