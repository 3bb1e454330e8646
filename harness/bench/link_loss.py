"""``bench-link``: loss fidelity of the link fallback without netem (`harness.links.fallback`, iptables
``statistic`` on the packets a container receives), between a coordinator and a worker container held
at the start gate (no training traffic).

For each loss asked, the coordinator's arriving packets are dropped through the fallback (netem taken as
absent, even where the kernel has it), the worker sends numbered UDP datagrams (small, one packet each:
no GRO), and the report keeps, beside the loss asked, the mechanism's own count (dropped / seen packets
of the chain) and the UDP count (1 - distinct datagrams received / sent). Writes
``bench-link-<stamp>.json`` with `machine_info` and `commit_info`. With ``--measure delay,capacity`` the
same pair measures the delay line instead or as well (`harness.bench.link_delay`); with ``--measure
reorder,duplicate,gemodel,loss-correlation,duplicate-correlation`` netem's per-packet impairments without
netem (`harness.bench.link_impair`).
With ``--netns`` the loss and delay probes and targets run through netem between two network namespaces
on this kernel (`harness.bench.link_netem`), and with ``--vm`` that check runs in a VM of Debian's kernel
(`harness.bench.link_vm`).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable


REPORT_NAME = "bench-link"
def measure(coordinator, worker, loss_pct: float, packets: int, caps, progress: Callable[[str], None]) -> dict[str, Any]:
    """One loss setting: apply it on the coordinator, send `packets` datagrams from the worker, read the
    chain's counters, reset. Returns the asked, counted and UDP loss in percent with the raw counts."""
    from harness.bench.link_udp import udp_trial
    from harness.links.plan import plan_shaping
    from harness.run.tc_exec import ContainerExec, apply_plan, read_fallback_counters, reset_links
    from harness.spec.links import LinkProfile

    runner = ContainerExec(coordinator)
    reset_links(runner)
    plan = plan_shaping(LinkProfile(loss_pct=loss_pct), dataclasses.replace(caps, netem=False))
    apply_plan(runner, plan)
    try:
        received = udp_trial(coordinator, worker, "coordinator", packets, f"{loss_pct:g} %")
        counters = read_fallback_counters(runner)
    finally:
        reset_links(runner)
    trial = {"loss_asked_pct": loss_pct, "mechanisms": plan.mechanisms, "sent_datagrams": packets,
             "received_datagrams": received, "udp_loss_pct": round(100 * (1 - received / packets), 6),
             "seen_packets": counters["seen_packets"], "dropped_packets": counters["dropped_packets"],
             "counted_loss_pct": counters["loss_pct"]}
    progress(f"[bench-link] asked {loss_pct:g} %: counted {counters['loss_pct']} % "
             f"({counters['dropped_packets']}/{counters['seen_packets']}), UDP {trial['udp_loss_pct']:.4f} %")
    return trial


MEASURES = ("loss", "delay", "capacity", "reorder", "duplicate", "gemodel", "loss-correlation",
            "duplicate-correlation")
NETEM_MEASURES = ("loss", "delay", "rate")  # --netns and --vm (harness.bench.link_netem)


def run_bench(losses_pct: list[float], packets: int, results_dir: Path, progress: Callable[[str], None],
              measures: tuple[str, ...] = ("loss",), rtts_ms: tuple[float, ...] = (), round_trips: int = 200,
              capacity_rtts_ms: tuple[float, ...] = (), flow_s: float = 10.0, impair_datagrams: int = 20_000) -> Path:
    """Start the pair, measure each of `losses_pct` (and, as `measures` asks, the delay line's round trips
    `rtts_ms` and a TCP flow at each of `capacity_rtts_ms` for `flow_s`; the trials of reorder, duplicate,
    gemodel and loss-correlation with `impair_datagrams` each, `harness.bench.link_impair.TRIALS`), remove
    the pair, write the JSON; return its path.

    Raises:
        ClusterError: the pair cannot start. LinkShapingError: the image or kernel has no statistic match
        (loss) or no delay line (delay, capacity, reorder, gemodel, loss-correlation), or no TEE target
        (duplicate).
    """
    from harness.bench import link_delay, link_impair
    from harness.errors import LinkShapingError
    from harness.run.compose_project import cluster_down, cluster_up
    from harness.run.docker_client import docker_client
    from harness.run.image import DEFAULT_TAG, ensure_image
    from harness.run.machine import commit_info, machine_info
    from harness.run.shaping import START_GATE_FILE, container_identity
    from harness.run.tc_exec import probe_capabilities
    from wiiide.config import RunConfig
    from wiiide.metrics import write_json_atomic

    image = ensure_image(os.environ.get("WIIIIIDE_IMAGE", DEFAULT_TAG), log=progress)
    caps = probe_capabilities(docker_client(), image)
    if "loss" in measures and not caps.statistic:
        raise LinkShapingError(f"bench-link: no iptables statistic match in {image} or the kernel: {caps.errors}")
    if {"duplicate", "duplicate-correlation"} & set(measures) and not (caps.tee and caps.statistic):
        raise LinkShapingError(f"bench-link: no TEE target (xt_TEE) in the kernel: {caps.errors}")
    if {"delay", "capacity", "reorder", "gemodel", "loss-correlation", "duplicate-correlation"} & set(measures) \
            and not caps.nfqueue:
        raise LinkShapingError(f"bench-link: no delay line (NFQUEUE and wiiide-delayline) in {image} or the kernel: "
                               f"{caps.errors}")
    extra: dict[str, Any] = {}
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    cfg = RunConfig(num_workers=1, duration_s=600, connect_timeout_s=600, start_gate_file=START_GATE_FILE,
                    log_tier="silent")
    try:
        with tempfile.TemporaryDirectory(prefix="bench-link-") as scratch:
            by_role = {container_identity(c)[0]: c for c in cluster_up(cfg, Path(scratch), image)}
            trials = [measure(by_role["coordinator"], by_role["worker"], pct, packets, caps, progress)
                      for pct in (losses_pct if "loss" in measures else [])]
            if "delay" in measures:
                extra["unshaped_rtt"] = link_delay.measure_unshaped_rtt(by_role, round_trips, progress)
                extra["delay_trials"] = [link_delay.measure_delay(by_role, rtt, round_trips, caps, progress)
                                         for rtt in rtts_ms]
            if "capacity" in measures:
                extra["unshaped_flow"] = link_delay.measure_unshaped(by_role, flow_s, progress)
                extra["capacity_trials"] = [link_delay.measure_capacity(by_role, rtt, flow_s, caps, progress)
                                            for rtt in capacity_rtts_ms]
            for kind in ("reorder", "duplicate", "gemodel", "loss-correlation", "duplicate-correlation"):
                if kind in measures:
                    extra[f"{kind.replace('-', '_')}_trials"] = [link_impair.measure_impairment(
                        by_role["coordinator"], by_role["worker"], keys, impair_datagrams, caps, progress)
                        for keys in link_impair.TRIALS[kind]]
    finally:
        cluster_down(progress)
    report = {"name": REPORT_NAME, "created_at_utc": started,
              "finished_at_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "machine_info": machine_info(), "commit_info": commit_info(), "image": image,
              "plan": {"measures": list(measures), "losses_pct": losses_pct, "datagrams": packets,
                       "rtts_ms": list(rtts_ms), "round_trips": round_trips,
                       "capacity_rtts_ms": list(capacity_rtts_ms), "flow_s": flow_s,
                       "impair_datagrams": impair_datagrams},
              "trials": trials, **extra}
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    path = results_dir / f"{REPORT_NAME}-{stamp}.json"
    write_json_atomic(path, report)
    return path


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The verb's options (the ``bench-link`` subparser of ``python -m harness``)."""
    p.add_argument("--loss", default="0.1,1,5", help="losses asked in percent, comma-separated (default 0.1,1,5)")
    p.add_argument("--datagrams", type=int, default=100_000, help="UDP datagrams per loss (default 100000)")
    p.add_argument("--measure", default=None,
                   help="what to measure, comma-separated: loss, delay, capacity, reorder, duplicate, gemodel, "
                        "loss-correlation, duplicate-correlation "
                        "(default loss); with --netns or --vm: loss, delay, rate (default all three)")
    p.add_argument("--impair-datagrams", type=int, default=20_000,
                   help="UDP datagrams per impairment trial (reorder, duplicate, gemodel, loss-correlation, "
                        "duplicate-correlation; default 20000)")
    p.add_argument("--delay", default="2,10,50,100",
                   help="round trips asked in ms for --measure delay, half on each container (default 2,10,50,100)")
    p.add_argument("--round-trips", type=int, default=200, help="TCP round trips per delay (default 200)")
    p.add_argument("--capacity", default="1,25",
                   help="round trips in ms of the TCP flow of --measure capacity (default 1,25)")
    p.add_argument("--seconds", type=float, default=10.0, help="length of each TCP flow in s (default 10)")
    p.add_argument("--rate", default="100mbit",
                   help="rates of --measure rate with --netns or --vm, comma-separated (default 100mbit)")
    p.add_argument("--netns", action="store_true",
                   help="through netem on this kernel, between two network namespaces (root; no Docker)")
    p.add_argument("--vm", action="store_true",
                   help="the --netns check in a KVM VM of Debian's kernel (for kernels without netem)")
    p.add_argument("--vm-timeout", type=float, default=600.0, help="the VM's time limit in s (default 600)")
    p.add_argument("--accel", choices=("auto", "kvm", "tcg"), default="auto",
                   help="with --vm: KVM, or TCG emulation (much slower); auto: KVM where it boots a stock kernel")
    p.add_argument("--results-dir", help=f"where {REPORT_NAME}-<stamp>.json goes (default results/)")


def main_from_args(args: argparse.Namespace, progress: Callable[[str], None] = print) -> int:
    """The CLI verb: parse the options, run, print the JSON's path; return 0.

    Raises:
        SpecError: a loss that is not a number in (0, 100), or fewer than 1 datagram.
    """
    from harness.errors import SpecError
    from harness import REPO_ROOT

    try:
        losses = [float(part) for part in args.loss.split(",") if part.strip()]
    except ValueError:
        raise SpecError(f"bench-link: --loss must be percentages separated by commas, got {args.loss!r}") from None
    if not losses or not all(0 < pct < 100 for pct in losses) or args.datagrams < 1:
        raise SpecError("bench-link: every --loss must be in (0, 100) percent and --datagrams >= 1")
    netem = args.netns or args.vm
    allowed = NETEM_MEASURES if netem else MEASURES
    text = args.measure if args.measure is not None else ",".join(NETEM_MEASURES) if netem else "loss"
    measures = tuple(part.strip() for part in text.split(",") if part.strip())
    if not measures or not set(measures) <= set(allowed):
        raise SpecError(f"bench-link: --measure takes {', '.join(allowed)} (comma-separated)"
                        f"{' with --netns or --vm' if netem else ''}, got {text!r}")
    rtts, capacity = _milliseconds(args.delay, "--delay"), _milliseconds(args.capacity, "--capacity")
    if args.round_trips < 1 or not 0 < args.seconds <= 600 or args.impair_datagrams < 1:
        raise SpecError("bench-link: --round-trips and --impair-datagrams must be >= 1 and --seconds in (0, 600]")
    if args.vm and (args.netns or not 0 < args.vm_timeout <= 3600):
        raise SpecError("bench-link: --vm runs --netns itself (give one), and --vm-timeout must be in (0, 3600] s")
    results_dir = Path(args.results_dir) if args.results_dir else REPO_ROOT / "results"
    results_dir.mkdir(parents=True, exist_ok=True)
    if netem:
        rates = _rates(args.rate)
        if args.netns:
            from harness.bench.link_netem import run_netns
            print(run_netns(losses, args.datagrams, rtts, args.round_trips, results_dir, progress, measures, rates))
            return 0
        from harness.bench.link_vm import run_vm
        options = ["--measure", ",".join(measures), "--loss", args.loss, "--datagrams", str(args.datagrams),
                   "--delay", args.delay, "--round-trips", str(args.round_trips), "--rate", args.rate]
        print(run_vm(options, results_dir, progress, args.vm_timeout, args.accel))
        return 0
    print(run_bench(losses, args.datagrams, results_dir, progress, measures, rtts, args.round_trips, capacity,
                    args.seconds, args.impair_datagrams))
    return 0


def _milliseconds(text: str, option: str) -> tuple[float, ...]:
    """Round trips in ms, comma-separated, each in (0, 10,000]. Raises SpecError naming `option`."""
    from harness.errors import SpecError

    try:
        values = tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise SpecError(f"bench-link: {option} must be round trips in ms separated by commas, got {text!r}") from None
    if not values or not all(0 < v <= 10_000 for v in values):
        raise SpecError(f"bench-link: every {option} round trip must be in (0, 10000] ms, got {text!r}")
    return values


def _rates(text: str) -> tuple[int, ...]:
    """Rates with units (``100mbit``), comma-separated, each > 0. Raises SpecError naming --rate."""
    from harness.errors import SpecError
    from wiiide.units import UnitError, parse_rate_bps

    try:
        values = tuple(parse_rate_bps(part.strip()) for part in text.split(",") if part.strip())
    except (UnitError, ValueError) as exc:
        raise SpecError(f"bench-link: --rate must be rates with units (100mbit) separated by commas: {exc}") from None
    if not values or not all(v > 0 for v in values):
        raise SpecError(f"bench-link: every --rate must be above 0, got {text!r}")
    return values


def main(argv: list[str] | None = None) -> int:
    """``python -m harness.bench.link_loss [options]``: the verb without the CLI's other imports (what the
    netem VM runs: under emulation each import costs seconds). Returns the exit code; a bad option or a
    kernel without netem prints the error and returns 2."""
    from harness.errors import LinkShapingError, SpecError

    parser = argparse.ArgumentParser(prog="python -m harness.bench.link_loss")
    add_arguments(parser)
    try:
        return main_from_args(parser.parse_args(argv), progress=lambda line: print(line, flush=True))
    except (SpecError, LinkShapingError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
