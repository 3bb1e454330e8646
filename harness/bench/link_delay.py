"""``bench-link --measure delay,capacity``: the delay line's fidelity and capacity between a coordinator
and a worker container held at the start gate (netem taken as absent, even where the kernel has it).

- delay: for each round trip asked, half of it is each container's delay on arrival
  (`harness.links.delayline`), and a TCP ping-pong (`harness.links.rtt`) measures the round trip: median
  and p99 beside what was asked, with each delay line's own account (lateness, packets). Targets: median
  within 5 % or 0.3 ms of the asked round trip, p99 within 10 % (no jitter).
- capacity: for each round trip asked, one TCP flow (iperf3, worker -> coordinator, ``-J``) through both
  delay lines (the data through the coordinator's, the ACKs through the worker's), its throughput and
  retransmits, and the delay lines' CPU seconds over the flow: CPU cores per Gbit/s. An unshaped flow of
  the same length first gives the pair's own ceiling. Target: >= 1 Gbit/s at 25 ms.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from typing import Any, Callable

IPERF_PORT = 5202
DELAY_TARGET_PCT, DELAY_TARGET_MS, P99_TARGET_PCT = 5.0, 0.3, 10.0


def _shape_both(by_role: dict, rtt_ms: float, caps) -> dict[str, Any]:
    """Half of `rtt_ms` on each container's arrivals through the delay line; returns the plans by role."""
    from harness.links.plan import plan_shaping
    from harness.run.tc_exec import ContainerExec, apply_plan, reset_links
    from harness.spec.links import LinkProfile

    plans = {}
    for role in ("coordinator", "worker"):
        runner = ContainerExec(by_role[role])
        reset_links(runner)
        plans[role] = plan_shaping(LinkProfile(delay_ms=rtt_ms / 2), dataclasses.replace(caps, netem=False))
        apply_plan(runner, plans[role])
    return plans


def _reset_both(by_role: dict) -> None:
    from harness.run.tc_exec import ContainerExec, reset_links

    for container in by_role.values():
        reset_links(ContainerExec(container))


def _delay_line_stats(by_role: dict) -> dict[str, Any]:
    from harness.run.tc_exec import ContainerExec, read_delay_line_stats

    return {role: read_delay_line_stats(ContainerExec(c)) for role, c in by_role.items()}


def within_target(median_ms: float, p99_ms: float, asked_ms: float) -> dict[str, bool]:
    """The issue's targets for one round trip: ``median_ok`` (|median - asked| <= max(5 % of asked,
    0.3 ms)) and ``p99_ok`` (p99 <= asked + max(10 % of asked, 0.3 ms); netem's p99 without jitter is its
    delay)."""
    tolerance = max(asked_ms * DELAY_TARGET_PCT / 100, DELAY_TARGET_MS)
    return {"median_ok": abs(median_ms - asked_ms) <= tolerance,
            "p99_ok": p99_ms - asked_ms <= max(asked_ms * P99_TARGET_PCT / 100, DELAY_TARGET_MS)}


def measure_unshaped_rtt(by_role: dict, round_trips: int, progress: Callable[[str], None]) -> dict[str, Any]:
    """The ping-pong with nothing in its path: the probe's own round trip between the two containers
    (median and p99 in ms). Every shaped round trip carries it, its tail included: a p99 above the asked
    delay by about the unshaped p99 is the endpoints' wake-ups, not the delay line's (whose own lateness
    its stats give, ``late_p99_us``)."""
    from harness.links import rtt

    _reset_both(by_role)
    return rtt.measure_unshaped(by_role["coordinator"], by_role["worker"], "coordinator", round_trips, progress)


def measure_delay(by_role: dict, rtt_ms: float, round_trips: int, caps, progress: Callable[[str], None]) -> dict[str, Any]:
    """One round trip asked: shape both, ping-pong `round_trips` times, read the delay lines, reset."""
    from harness.links import rtt

    plans = _shape_both(by_role, rtt_ms, caps)
    try:
        samples = rtt.measure_rtt(by_role["coordinator"], by_role["worker"], "coordinator",
                                  round_trips + rtt.WARMUP_SAMPLES)
        stats = _delay_line_stats(by_role)
    finally:
        _reset_both(by_role)
    summary = rtt.summarize(samples, rtt_ms)
    trial = {"rtt_asked_ms": rtt_ms, "mechanisms": {role: p.mechanisms for role, p in plans.items()}, **summary,
             **within_target(summary["median_rtt_ms"], summary["p99_rtt_ms"], rtt_ms), "delay_lines": stats}
    progress(f"[bench-link] round trip {rtt_ms:g} ms asked: median {summary['median_rtt_ms']:.3f} ms, "
             f"p99 {summary['p99_rtt_ms']:.3f} ms over {summary['samples']} "
             f"(median {'ok' if trial['median_ok'] else 'MISSED'}, p99 {'ok' if trial['p99_ok'] else 'MISSED'})")
    return trial


def iperf_flow(by_role: dict, seconds: float) -> dict[str, Any]:
    """One iperf3 TCP flow from the worker to the coordinator for `seconds`: ``throughput_bps`` (what the
    receiver got), ``retransmits``, the duration, and the sender's largest congestion and send windows
    (``max_snd_cwnd_bytes``, ``max_snd_wnd_bytes``) and mean smoothed RTT (``mean_rtt_ms``). Raises RuntimeError when iperf3 fails."""
    result: dict[str, Any] = {}
    server = threading.Thread(target=lambda: result.update(exec=by_role["coordinator"].exec_run(
        ["iperf3", "-s", "-1", "-p", str(IPERF_PORT)], demux=True)), daemon=True)
    server.start()
    time.sleep(0.5)  # the server's listen (iperf3's client does not retry its connect)
    code, output = by_role["worker"].exec_run(
        ["iperf3", "-c", "coordinator", "-p", str(IPERF_PORT), "-t", f"{seconds:g}", "-J"], demux=True)
    server.join(timeout=seconds + 30)
    out = (output[0] if isinstance(output, tuple) else output) or b""
    try:
        end = json.loads(out)["end"]
        sender = (end.get("streams") or [{}])[0].get("sender", {})
        return {"throughput_bps": round(end["sum_received"]["bits_per_second"]),
                "retransmits": end["sum_sent"].get("retransmits"), "duration_s": end["sum_received"]["seconds"],
                # the sender's TCP_INFO as iperf3 sampled it: what bounded the window (bytes, rtt in us)
                "max_snd_cwnd_bytes": sender.get("max_snd_cwnd"), "max_snd_wnd_bytes": sender.get("max_snd_wnd"),
                "mean_rtt_ms": sender["mean_rtt"] / 1000 if isinstance(sender.get("mean_rtt"), (int, float)) else None}
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise RuntimeError(f"bench-link: iperf3 failed (exit {code}, {exc}): {out[-300:]!r}") from None


def measure_capacity(by_role: dict, rtt_ms: float, seconds: float, caps,
                     progress: Callable[[str], None]) -> dict[str, Any]:
    """One TCP flow through both delay lines at `rtt_ms`: its throughput and the delay lines' CPU."""
    _shape_both(by_role, rtt_ms, caps)
    try:
        before = _delay_line_stats(by_role)
        flow = iperf_flow(by_role, seconds)
        after = _delay_line_stats(by_role)
    finally:
        _reset_both(by_role)
    cpu_s = {role: round(after[role]["cpu_s"] - before[role]["cpu_s"], 6) for role in after}
    cores = sum(cpu_s.values()) / flow["duration_s"]
    gbps = flow["throughput_bps"] / 1e9
    trial = {"rtt_asked_ms": rtt_ms, **flow, "delay_line_cpu_s": cpu_s, "delay_line_cores": round(cores, 4),
             "delay_line_cores_per_gbps": round(cores / gbps, 4) if gbps else None,
             "meets_1gbps": flow["throughput_bps"] >= 1e9,
             "delay_lines": after}
    progress(f"[bench-link] one TCP flow at {rtt_ms:g} ms: {gbps:.3f} Gbit/s, {flow['retransmits']} retransmits, "
             f"delay lines {cores:.3f} cores ({trial['delay_line_cores_per_gbps']} per Gbit/s)")
    return trial


def measure_unshaped(by_role: dict, seconds: float, progress: Callable[[str], None]) -> dict[str, Any]:
    """The same flow with nothing in its path: the pair's own ceiling on this machine."""
    _reset_both(by_role)
    flow = iperf_flow(by_role, seconds)
    progress(f"[bench-link] one TCP flow, unshaped: {flow['throughput_bps'] / 1e9:.3f} Gbit/s")
    return flow
