"""``bench-link --netns``: the same fidelity check as the delay line's and the fallback's loss, through
netem, on this kernel, between two network namespaces joined by a veth pair (no Docker). It is what
the VM of ``bench-link --vm`` runs (`harness.bench.link_vm`), and it runs as well on any Linux host
with ``sch_netem`` (root).

Each namespace's end of the pair is named ``eth0``, as a container's interface, so the shaping commands
are the docker path's own: `harness.links.plan.plan_shaping` of a `LinkProfile` with the kernel's
probed capabilities (`harness.run.tc_exec.probe_with`), applied and read back by
`harness.run.tc_exec.apply_plan` through a `NetnsPeer` (a namespace with the ``exec_run`` of a docker
SDK container). The probes are the docker benchmark's: the TCP ping-pong of `harness.links.rtt` and
the numbered UDP datagrams of `harness.bench.link_udp.udp_trial`; the targets are
`harness.bench.link_delay.within_target` and `LOSS_TARGET_REL_PCT`.

- delay: half of each round trip asked on each namespace's egress (netem ``delay``, jitter 0).
- loss: netem ``loss`` on the sender's egress; the count is netem's own (its qdisc's ``drops`` over
  drops + sent packets, ``tc -s``) beside the UDP count.
- rate (``--measure rate``): htb at the rate with netem (`RATE_DELAY_MS`) under it on the sender's
  egress, and the bulk TCP flow of `harness.links.window` (kernel's buffer autotuning); target 90 % to
  100 % of the rate (`RATE_TARGET_MIN`, `RATE_TARGET_MAX`: headers are 4.4 % of a full frame).
"""

from __future__ import annotations

import platform
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Sequence

from harness.errors import LinkShapingError

REPORT_NAME = "bench-link-netem"
NAMESPACES = ("wiiide-netem-a", "wiiide-netem-b")  # the receiver (coordinator's place), the sender
ADDRESSES = ("10.231.0.1", "10.231.0.2")
LOSS_TARGET_REL_PCT = 15.0
# A rate's goodput: TCP/IP headers take 66 of each 1514-byte frame (4.4 %), so 90 % to 100 % of the rate
RATE_TARGET_MIN, RATE_TARGET_MAX = 0.90, 1.0
RATE_DELAY_MS = 5.0
EXEC_TIMEOUT_S = 180.0


class NetnsPeer:
    """A network namespace (`netns`, made by `pair_up`) that runs argv lists as a container would: the
    ``exec_run(argv, demux=True, detach=False)`` of the docker SDK, through ``ip netns exec`` (argv[0]
    ``python`` is this interpreter, without ``site``: the probes' scripts use only the standard library). `name` is how messages name it."""

    def __init__(self, netns: str) -> None:
        self.name = netns
        self._started: list[subprocess.Popen] = []

    def argv(self, argv: Sequence[str]) -> list[str]:
        """The host argv that runs `argv` in the namespace."""
        argv = list(argv)
        if argv and argv[0] == "python":  # the probes' scripts need only the standard library: no site
            argv[0:1] = [sys.executable, "-S"]
        return ["ip", "netns", "exec", self.name, *argv]

    def exec_run(self, argv: Sequence[str], demux: bool = False, detach: bool = False):
        """Run `argv` in the namespace: ``(exit code, (stdout, stderr))`` with `demux`, else ``(exit code,
        stdout + stderr)``; with `detach`, start it and return ``(None, None)`` (stopped by `close`)."""
        if detach:
            self._started.append(subprocess.Popen(self.argv(argv), stdout=subprocess.DEVNULL,
                                                  stderr=subprocess.DEVNULL))
            return None, None
        try:
            done = subprocess.run(self.argv(argv), capture_output=True, timeout=EXEC_TIMEOUT_S, check=False)
        except subprocess.TimeoutExpired as exc:
            return 124, ((exc.stdout or b""), (exc.stderr or b"") + b"timed out")
        return done.returncode, ((done.stdout, done.stderr) if demux else done.stdout + done.stderr)

    def close(self) -> None:
        """Stop what `exec_run` started detached (by its own PID)."""
        for proc in self._started:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        self._started.clear()


def pair_commands(namespaces: Sequence[str] = NAMESPACES, addresses: Sequence[str] = ADDRESSES) -> list[list[str]]:
    """Two namespaces joined by a veth pair whose ends are both ``eth0`` (one in each), addressed in a
    /24 of their own, up, with their loopbacks up."""
    a, b = namespaces
    commands = [["ip", "netns", "add", a], ["ip", "netns", "add", b],
                ["ip", "link", "add", "wiiide-va", "type", "veth", "peer", "name", "wiiide-vb"],
                ["ip", "link", "set", "wiiide-va", "netns", a], ["ip", "link", "set", "wiiide-vb", "netns", b]]
    for ns, dev, addr in ((a, "wiiide-va", addresses[0]), (b, "wiiide-vb", addresses[1])):
        commands += [["ip", "-n", ns, "link", "set", dev, "name", "eth0"],
                     ["ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0"],
                     ["ip", "-n", ns, "link", "set", "eth0", "up"], ["ip", "-n", ns, "link", "set", "lo", "up"]]
    return commands


def _ip(argv: list[str], check: bool = True) -> None:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    if check and done.returncode != 0:
        raise LinkShapingError(f"bench-link --netns: `{' '.join(argv)}` failed: {done.stderr.strip()}")


def pair_up() -> tuple[NetnsPeer, NetnsPeer]:
    """Make the two namespaces (`pair_commands`; leftovers of an earlier run removed first). Raises
    LinkShapingError when a command fails (not root, no veth)."""
    pair_down()
    for argv in pair_commands():
        _ip(argv)
    return NetnsPeer(NAMESPACES[0]), NetnsPeer(NAMESPACES[1])


def pair_down(peers: Sequence[NetnsPeer] = ()) -> None:
    """Stop the peers' detached commands and delete both namespaces (the veth pair goes with them)."""
    for peer in peers:
        peer.close()
    for ns in NAMESPACES:
        _ip(["ip", "netns", "del", ns], check=False)


def _netem_record(records: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    for recs in records.values():
        for rec in recs:
            if rec.get("type") == "qdisc" and rec.get("kind") == "netem":
                return rec
    raise LinkShapingError(f"no netem qdisc read back: {records}")


def _shape(peer: NetnsPeer, profile, caps) -> tuple[Any, dict[str, Any]]:
    from harness.links.plan import plan_shaping
    from harness.run.tc_exec import ContainerExec, apply_plan, reset_links

    runner = ContainerExec(peer)
    reset_links(runner)
    plan = plan_shaping(profile, caps)
    return plan, _netem_record(apply_plan(runner, plan))


def _reset(peers: Sequence[NetnsPeer]) -> None:
    from harness.run.tc_exec import ContainerExec, reset_links

    for peer in peers:
        reset_links(ContainerExec(peer))


def loss_within_target(counted_pct: float, asked_pct: float) -> bool:
    """Whether a counted loss is within `LOSS_TARGET_REL_PCT` (15 %) of the asked one, relative."""
    return abs(counted_pct - asked_pct) <= asked_pct * LOSS_TARGET_REL_PCT / 100


def measure_unshaped(peers: Sequence[NetnsPeer], round_trips: int, progress: Callable[[str], None]) -> dict[str, Any]:
    """The ping-pong with nothing in its path: the probe's own round trip on this machine (under
    emulation it is milliseconds, and every shaped median carries it)."""
    from harness.links import rtt

    _reset(peers)
    return rtt.measure_unshaped(peers[0], peers[1], ADDRESSES[0], round_trips, progress)


def measure_delay(peers: Sequence[NetnsPeer], rtt_ms: float, round_trips: int, caps,
                  progress: Callable[[str], None], unshaped_median_ms: float = 0.0) -> dict[str, Any]:
    """One round trip asked: netem with half of it on each namespace's egress, the ping-pong from the
    sender to the receiver, tc's read-back, reset. ``added_median_ms`` is the median less
    `unshaped_median_ms` (the probe's own round trip), with ``added_median_ok`` by the median's target."""
    from harness.bench.link_delay import within_target
    from harness.links import rtt
    from harness.spec.links import LinkProfile

    shaped = [_shape(peer, LinkProfile(name=f"netem-{rtt_ms:g}ms", delay_ms=rtt_ms / 2), caps) for peer in peers]
    try:
        samples = rtt.measure_rtt(peers[0], peers[1], ADDRESSES[0], round_trips + rtt.WARMUP_SAMPLES)
    finally:
        _reset(peers)
    summary = rtt.summarize(samples, rtt_ms)
    trial = {"rtt_asked_ms": rtt_ms, "commands": {p.name: [list(c) for c in plan.commands] for p, (plan, _) in
                                                  zip(peers, shaped)},
             "mechanisms": {p.name: dict(plan.mechanisms) for p, (plan, _) in zip(peers, shaped)},
             "netem_read_back": {p.name: rec for p, (_, rec) in zip(peers, shaped)}, **summary,
             **within_target(summary["median_rtt_ms"], summary["p99_rtt_ms"], rtt_ms)}
    added = round(summary["median_rtt_ms"] - unshaped_median_ms, 4)
    trial.update(added_median_ms=added, added_median_ok=within_target(added, added, rtt_ms)["median_ok"])
    progress(f"[bench-link] netem round trip {rtt_ms:g} ms asked: median {summary['median_rtt_ms']:.3f} ms, "
             f"p99 {summary['p99_rtt_ms']:.3f} ms over {summary['samples']}, {added:.3f} ms over the unshaped "
             f"(median {'ok' if trial['median_ok'] else 'MISSED'}, p99 {'ok' if trial['p99_ok'] else 'MISSED'})")
    return trial


def measure_loss(peers: Sequence[NetnsPeer], loss_pct: float, packets: int, caps,
                 progress: Callable[[str], None]) -> dict[str, Any]:
    """One loss asked: netem loss on the sender's egress, `packets` UDP datagrams to the receiver,
    netem's own count (read back after the trial) beside the UDP count, reset."""
    from harness.bench.link_udp import udp_trial
    from harness.run.tc_exec import ContainerExec, read_back
    from harness.spec.links import LinkProfile

    plan, _ = _shape(peers[1], LinkProfile(name=f"netem-loss-{loss_pct:g}", loss_pct=loss_pct), caps)
    try:
        received = udp_trial(peers[0], peers[1], ADDRESSES[0], packets, f"{loss_pct:g} % (netem)")
        netem = _netem_record(read_back(ContainerExec(peers[1]), plan.devices))
    finally:
        _reset(peers)
    drops, sent = netem.get("drops", 0), netem.get("sent_packets", 0)
    counted = round(100 * drops / (drops + sent), 6) if drops + sent else 0.0
    udp = round(100 * (1 - received / packets), 6)
    trial = {"loss_asked_pct": loss_pct, "commands": [list(c) for c in plan.commands],
             "mechanisms": dict(plan.mechanisms), "sent_datagrams": packets, "received_datagrams": received,
             "udp_loss_pct": udp, "seen_packets": drops + sent, "dropped_packets": drops,
             "counted_loss_pct": counted, "counted_ok": loss_within_target(counted, loss_pct),
             "udp_ok": loss_within_target(udp, loss_pct)}
    progress(f"[bench-link] netem loss {loss_pct:g} % asked: counted {counted} % ({drops}/{drops + sent}), "
             f"UDP {udp:.4f} % ({'ok' if trial['counted_ok'] and trial['udp_ok'] else 'MISSED'})")
    return trial


def measure_rate(peers: Sequence[NetnsPeer], rate_bps: int, delay_ms: float, caps,
                 progress: Callable[[str], None]) -> dict[str, Any]:
    """One rate asked: htb at `rate_bps` with netem `delay_ms` under it on the sender's egress, one bulk
    TCP flow to the receiver (`harness.links.window.measure_window`, autotuned buffers), reset."""
    from harness.links.window import measure_window
    from harness.spec.links import LinkProfile

    profile = LinkProfile(name=f"netem-rate-{rate_bps}", rate_bps=rate_bps, delay_ms=delay_ms)
    plan, netem = _shape(peers[1], profile, caps)
    try:
        flow = measure_window(peers[0], peers[1], ADDRESSES[0], 0, 0)
    finally:
        _reset(peers)
    ratio = flow["throughput_bps"] / rate_bps
    trial = {"rate_asked_bps": rate_bps, "delay_ms": delay_ms, "commands": [list(c) for c in plan.commands],
             "netem_read_back": netem, "throughput_bps": round(flow["throughput_bps"]),
             "measured_s": flow["measured_s"], "of_rate": round(ratio, 4),
             "rate_ok": RATE_TARGET_MIN <= ratio <= RATE_TARGET_MAX}
    progress(f"[bench-link] netem + htb {rate_bps / 1e6:g} Mbit/s at {delay_ms:g} ms: "
             f"{flow['throughput_bps'] / 1e6:.1f} Mbit/s ({100 * ratio:.1f} %, {'ok' if trial['rate_ok'] else 'MISSED'})")
    return trial


def kernel_facts() -> dict[str, Any]:
    """The kernel the check ran on (``uname``), and iproute2's version. Raises nothing."""
    try:
        tc = subprocess.run(["tc", "-V"], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        tc = None
    return {"kernel": platform.release(), "kernel_build": platform.version(), "machine": platform.machine(),
            "python": platform.python_version(), "tc_version": tc}


def run_netns(losses_pct: Sequence[float], packets: int, rtts_ms: Sequence[float], round_trips: int,
              results_dir: Path, progress: Callable[[str], None], measures: Sequence[str] = ("loss", "delay"),
              rates_bps: Sequence[int] = (), rate_delay_ms: float = RATE_DELAY_MS) -> Path:
    """Make the pair, probe the kernel, measure each delay of `rtts_ms` and loss of `losses_pct` (as
    `measures` asks) and one TCP flow at each rate of `rates_bps` with `rate_delay_ms`, remove the pair, write ``bench-link-netem-<stamp>.json`` to `results_dir`; return
    its path.

    Raises:
        LinkShapingError: the pair cannot be made (not root), or this kernel has no netem.
    """
    from harness.run.tc_exec import ContainerExec, probe_with
    from wiiide.atomic_write import write_json_atomic

    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    peers = pair_up()
    try:
        caps = probe_with(ContainerExec(peers[0]))
        if not caps.netem:
            raise LinkShapingError(f"bench-link --netns: this kernel ({platform.release()}) has no netem: "
                                   f"{caps.errors.get('netem')}")
        progress(f"[bench-link] netem on {platform.release()}: namespaces {' and '.join(NAMESPACES)} up")
        unshaped = measure_unshaped(peers, round_trips, progress) if "delay" in measures else None
        delays = [measure_delay(peers, rtt, round_trips, caps, progress, unshaped["median_rtt_ms"])
                  for rtt in rtts_ms] if unshaped else []
        losses = [measure_loss(peers, pct, packets, caps, progress) for pct in losses_pct] if "loss" in measures else []
        rates = [measure_rate(peers, r, rate_delay_ms, caps, progress) for r in rates_bps] if "rate" in measures else []
    finally:
        pair_down(peers)
    report = {"name": REPORT_NAME, "created_at_utc": started,
              "finished_at_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "kernel": kernel_facts(), "capabilities": caps.to_dict(),
              "plan": {"measures": list(measures), "losses_pct": list(losses_pct), "datagrams": packets,
                       "rtts_ms": list(rtts_ms), "round_trips": round_trips, "rates_bps": list(rates_bps),
                       "rate_delay_ms": rate_delay_ms},
              "unshaped_rtt": unshaped, "delay_trials": delays, "loss_trials": losses, "rate_trials": rates,
              "all_ok": all(t["median_ok"] and t["p99_ok"] for t in delays)
                        and all(t["counted_ok"] and t["udp_ok"] for t in losses)
                        and all(t["rate_ok"] for t in rates)}
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    path = results_dir / f"{REPORT_NAME}-{stamp}.json"
    write_json_atomic(path, report)
    return path
