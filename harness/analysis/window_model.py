"""The window model of a socket buffer on a link with delay, beside what each point measured.

One TCP flow cannot carry more than its window per round trip, nor more than the link's rate:

    model_bps = min(rate_bps, 8 * window_bytes / rtt_s)

(the bandwidth-delay product argument; e.g. Mathis et al., "The macroscopic behavior of the TCP
congestion avoidance algorithm", 1997, and RFC 7323 section 1 for why the window must cover rate x RTT).
``window_bytes`` is what the smaller of the two buffers leaves for data: Linux's ``getsockopt`` reads
back twice the ``SO_SNDBUF``/``SO_RCVBUF`` request (socket(7): the doubled part is kept for bookkeeping),
and TCP counts part of a buffer as overhead: ``bytes / 2^tcp_adv_win_scale`` when the sysctl is > 0,
``bytes - bytes / 2^-tcp_adv_win_scale`` when it is <= 0 (Documentation/networking/ip-sysctl.rst,
``tcp_adv_win_scale``; default 1, so half a read-back buffer is data: the request). ``rtt_s`` is the
median of the round-trip probe (``links.rtt_probe``), ``rate_bps`` the rate the htb class read back on
worker 1 (the probe's sender), and the measured figure the window probe's (``links.window_probe``,
`harness.links.window`): one bulk flow from worker 1 to the coordinator with the point's buffers.

``python -m harness.analysis.window_model REPORT [--json]`` prints one row per repeat that has both
probes: buffers, window, RTT, model, measured, error and which bound the model says holds; the
training's goodput of the same point stands beside it (its messages are 1.2 MB, so it reads the window
only where a message needs several round trips). A second reading takes the window the kernel itself
keeps: the receiver's ``rcv_ssthresh`` from ``ss -tmi`` during the probe (the most it advertises; since
Linux 6.6 the receiver scales a buffer by the measured payload share of its packets rather than by
``tcp_adv_win_scale``), bounded by the sender's read-back buffer.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

DEFAULT_ADV_WIN_SCALE = 1  # ip-sysctl.rst's default, used when the report recorded no value
TARGET_ERROR = 0.15


def data_fraction(adv_win_scale: int) -> float:
    """The share of a socket buffer TCP gives the data for a ``tcp_adv_win_scale`` of `adv_win_scale`
    (ip-sysctl.rst: overhead ``bytes/2^s`` for s > 0, ``bytes - bytes/2^-s`` for s <= 0); 0.5 at 1.

    Raises:
        ValueError: `adv_win_scale` outside [-31, 31] (the sysctl's range).
    """
    if not -31 <= adv_win_scale <= 31:
        raise ValueError(f"tcp_adv_win_scale must be in [-31, 31], got {adv_win_scale}")
    return 1 - 2.0 ** -adv_win_scale if adv_win_scale > 0 else 2.0 ** adv_win_scale


def model_bps(rate_bps: float | None, window_bytes: float, rtt_s: float) -> tuple[float, str]:
    """``min(rate_bps, 8 window_bytes / rtt_s)`` in bit/s and the bound that holds (``"rate"`` or
    ``"window"``); without a rate (None: unshaped) the window's figure, bound ``"window"``.

    Raises:
        ValueError: `rtt_s` or `window_bytes` not > 0.
    """
    if rtt_s <= 0 or window_bytes <= 0:
        raise ValueError(f"the window model needs a window and a round trip > 0, got {window_bytes} B, {rtt_s} s")
    window_rate = 8 * window_bytes / rtt_s
    if rate_bps is not None and rate_bps <= window_rate:
        return float(rate_bps), "rate"
    return window_rate, "window"


@dataclass
class WindowRow:
    """One repeat's reading: bytes, seconds and bit/s as named; `error` is model / measured - 1."""

    params: dict[str, Any]
    repeat: int
    sndbuf_requested_bytes: int
    sndbuf_bytes: int
    rcvbuf_bytes: int
    adv_win_scale: int
    adv_win_scale_recorded: bool
    window_bytes: float
    rtt_s: float
    rate_bps: float | None
    model_bps: float
    bound: str
    measured_bps: float
    error: float
    training_goodput_bps: float | None
    kernel_window_bytes: float | None = None  # min(the receiver's rcv_ssthresh (ss), the sender's read-back)
    kernel_model_bps: float | None = None
    kernel_error: float | None = None


def _sender_rate_bps(links: dict[str, Any]) -> float | None:
    """The rate read back on worker 1's egress (the window probe's sender); None when unshaped."""
    for record in (links.get("containers") or {}).values():
        if record.get("role") == "worker" and record.get("worker_index") == 1:
            rate = record.get("applied_rate_bps")
            return float(rate) if isinstance(rate, (int, float)) and rate > 0 else None
    return None


def _adv_win_scale(probe: dict[str, Any]) -> tuple[int, bool]:
    """The probe's ``net.ipv4.tcp_adv_win_scale`` and whether it was recorded (else the default)."""
    value = (probe.get("sysctls") or {}).get("net.ipv4.tcp_adv_win_scale")
    try:
        return int(value[0]), True
    except (TypeError, ValueError, IndexError):
        return DEFAULT_ADV_WIN_SCALE, False


def repeat_row(params: dict[str, Any], repeat: dict[str, Any]) -> WindowRow | None:
    """A repeat of a sweep report (its ``links`` and ``nodes``) -> its `WindowRow`, or None when it has
    no measured round trip or window probe (an unshaped point, or a probe that failed)."""
    links = repeat.get("links") or {}
    rtt, probe = links.get("rtt_probe") or {}, links.get("window_probe") or {}
    if "median_rtt_ms" not in rtt or "throughput_bps" not in probe or probe.get("error"):
        return None
    scale, recorded = _adv_win_scale(probe)
    window = min(probe["sndbuf_bytes"], probe["rcvbuf_bytes"]) * data_fraction(scale)
    rtt_s = rtt["median_rtt_ms"] / 1e3
    rate = _sender_rate_bps(links)
    model, bound = model_bps(rate, window, rtt_s)
    measured = float(probe["throughput_bps"])
    kernel_window = kernel_model = kernel_error = None
    if isinstance(probe.get("receiver_window_bytes"), int) and probe["receiver_window_bytes"] > 0:
        kernel_window = float(min(probe["receiver_window_bytes"], probe["sndbuf_bytes"]))
        kernel_model = model_bps(rate, kernel_window, rtt_s)[0]
        kernel_error = (kernel_model / measured - 1) if measured > 0 else float("inf")
    coordinator = (repeat.get("nodes") or {}).get("coordinator") or {}
    goodput = coordinator.get("goodput_bps")
    return WindowRow(params=dict(params), repeat=int(repeat.get("repeat", 0)),
                     sndbuf_requested_bytes=int(probe.get("sndbuf_requested_bytes", 0)),
                     sndbuf_bytes=int(probe["sndbuf_bytes"]), rcvbuf_bytes=int(probe["rcvbuf_bytes"]),
                     adv_win_scale=scale, adv_win_scale_recorded=recorded, window_bytes=window, rtt_s=rtt_s,
                     rate_bps=rate, model_bps=model, bound=bound, measured_bps=measured,
                     error=(model / measured - 1) if measured > 0 else float("inf"),
                     training_goodput_bps=float(goodput) if isinstance(goodput, (int, float)) else None,
                     kernel_window_bytes=kernel_window, kernel_model_bps=kernel_model, kernel_error=kernel_error)


def report_rows(report: dict[str, Any]) -> list[WindowRow]:
    """Every repeat of a sweep report (``report.json`` as a dict) with both probes, in point order."""
    rows = []
    for point in report.get("points") or []:
        for repeat in point.get("repeats") or []:
            row = repeat_row(point.get("params") or {}, repeat)
            if row is not None:
                rows.append(row)
    return rows


def render(rows: Sequence[WindowRow]) -> str:
    """Rows as text: point, buffers read back (MiB), window (MiB), RTT (ms), rate, model and measured
    (Mbit/s), error (model / measured - 1, ``*`` within `TARGET_ERROR`), bound, training goodput."""
    if not rows:
        return "no repeat with both a round-trip probe and a window probe (a link with delay records them)"
    labels = [", ".join(f"{k}={v}" for k, v in row.params.items()) for row in rows]
    width = max(24, *map(len, labels))
    lines = [f"{'point':{width}} {'snd/rcv MiB':>11} {'window MiB':>10} {'RTT ms':>7} {'rate Mbit/s':>11} "
             f"{'model Mbit/s':>12} {'measured Mbit/s':>15} {'error':>8} {'bound':>6} {'training Mbit/s':>15} "
             f"{'kernel window MiB':>17} {'its model':>9} {'error':>8}"]
    for row, label in zip(rows, labels):
        rate = f"{row.rate_bps / 1e6:11.0f}" if row.rate_bps else f"{'-':>11}"
        goodput = f"{row.training_goodput_bps / 1e6:15.1f}" if row.training_goodput_bps else f"{'-':>15}"
        mark = "*" if abs(row.error) <= TARGET_ERROR else " "
        buffers = f"{row.sndbuf_bytes / 2**20:g}/{row.rcvbuf_bytes / 2**20:g}"
        lines.append(f"{label:{width}} {buffers:>11} {row.window_bytes / 2**20:10.2f} {row.rtt_s * 1e3:7.2f} {rate} "
                     f"{row.model_bps / 1e6:12.1f} {row.measured_bps / 1e6:15.1f} {row.error * 100:+6.1f}%{mark} "
                     f"{row.bound:>6} {goodput}{_kernel_cells(row)}")
    if not all(row.adv_win_scale_recorded for row in rows):
        lines.append(f"(tcp_adv_win_scale not recorded for some rows: the default {DEFAULT_ADV_WIN_SCALE} assumed)")
    return "\n".join(lines)


def _kernel_cells(row: WindowRow) -> str:
    """The kernel's own window (MiB), its model (Mbit/s) and error, or dashes when not recorded."""
    if row.kernel_window_bytes is None or row.kernel_model_bps is None or row.kernel_error is None:
        return f" {'-':>17} {'-':>9} {'-':>8}"
    mark = "*" if abs(row.kernel_error) <= TARGET_ERROR else " "
    return (f" {row.kernel_window_bytes / 2**20:17.2f} {row.kernel_model_bps / 1e6:9.1f} "
            f"{row.kernel_error * 100:+6.1f}%{mark}")


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m harness.analysis.window_model REPORT [--json]``; exit 2 when REPORT is unreadable."""
    parser = argparse.ArgumentParser(prog="python -m harness.analysis.window_model", description=__doc__.split("\n")[0])
    parser.add_argument("report", help="a sweep's report.json or its directory")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args(argv)
    path = Path(args.report)
    path = path / "report.json" if path.is_dir() else path
    try:
        report = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        print(f"{path}: not a readable sweep report ({exc})", file=sys.stderr)
        return 2
    rows = report_rows(report)
    print(json.dumps([asdict(r) for r in rows], indent=1) if args.json else render(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
