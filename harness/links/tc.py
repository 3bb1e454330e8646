"""Pure builders of the tc and ip argv lists that shape one container's links, and the sizes they
derive. Nothing here runs a command or formats report text: `harness.run.tc_exec` runs the lists in a
container, `harness.links.plan` chooses them for a kernel's qdiscs, `harness.links.readback` reads back
what tc has in force, and `harness.present.links_text` writes the report's cells.

The qdisc tree of one interface is built in one go, as Mininet's ``TCIntf.config()`` does
(mininet/link.py): a rate class at the root (htb, or tbf) and netem as its child for delay, jitter
and loss. Without a rate, netem is the root. Ingress shaping redirects the interface's ingress to an
ifb device (``ifb0``, made inside the container's network namespace) and builds the same tree there.
Each profile (`harness.spec.links.LinkProfile`) is one frozen value object validated when built, and
pure functions return its tc commands (after Pumba's netem commands, alexei-led/pumba), so every
command is tested without root and a dry run shows exactly what would run.

Sizes the tree derives (every one documented where it is computed):

- tbf and htb burst: ``rate / KERNEL_HZ`` bytes, at least `MIN_BURST_BYTES`. A token bucket must hold
  at least one timer tick of traffic (tc-tbf(8), "burst": "the minimum buffer size can be calculated
  by dividing the rate by HZ"); with 16 KiB at 1 Gbit/s tbf reached only 75 % of the rate on this
  machine, with rate/HZ it reached 95 % (TCP/IP headers are the other 4.4 %).
- netem limit: the bandwidth-delay product in packets, times `NETEM_LIMIT_HEADROOM`, at least netem's
  default of 1,000 packets, which throttles long fat links (tc-netem(8), "limit").
- tbf limit (bytes of queue): `TBF_QUEUE_S` seconds of the rate plus the burst, or
  ``limit_packets`` full-size frames when the profile sets it (tc-tbf(8), "limit or latency").
- htb quantum: rate / r2q (tc-htb(8), r2q 10), clamped below the 200,000 bytes above which the kernel
  warns "quantum of class ... is big" (net/sched/sch_htb.c).
"""

from __future__ import annotations

import math

from harness.errors import LinkShapingError
from harness.spec.links import LinkProfile

DEFAULT_DEV = "eth0"  # the one interface of a container on one Compose network


IFB_DEV = "ifb0"  # made inside the container's network namespace; it goes with the namespace


IFB_TXQUEUELEN = 1000




KERNEL_HZ = 250  # CONFIG_HZ of these machines' kernel; a smaller HZ would need a bigger burst


MIN_BURST_BYTES = 16 * 1024


TBF_QUEUE_S = 0.1  # tbf's queue: 100 ms of the rate (plus the burst)


MTU_BYTES = 1500


FRAME_BYTES = 1514  # MTU plus the Ethernet header, as qdiscs count packets


NETEM_DEFAULT_LIMIT = 1000  # packets, netem's own default


NETEM_LIMIT_HEADROOM = 1.5


NOMINAL_LINE_RATE_BPS = 10 * 10**9  # for netem's limit when a profile sets no rate (veth: ~9 Gbit/s here)


HTB_MAX_QUANTUM_BYTES = 200_000  # above this htb warns "quantum of class is big"


def _us(ms: float) -> str:
    """Milliseconds as a tc time argument in whole microseconds (exact, never '1e-05ms')."""
    return f"{int(round(ms * 1000))}us"


def _pct_arg(pct: float) -> str:
    """A percentage as a tc argument (``0.5%``, ``25%``), without float noise."""
    return f"{pct:.6f}".rstrip("0").rstrip(".") + "%"


def burst_bytes(rate_bps: int) -> int:
    """Token-bucket burst for tbf and htb, in bytes, for a rate in bit/s: one timer tick of the rate
    (rate / 8 / `KERNEL_HZ`, tc-tbf(8)), at least `MIN_BURST_BYTES` (16 KiB). Raises nothing."""
    return max(math.ceil(rate_bps / 8 / KERNEL_HZ), MIN_BURST_BYTES)


def netem_limit_packets(profile: LinkProfile) -> int:
    """netem's queue in packets: the profile's limit_packets, else `NETEM_LIMIT_HEADROOM` (1.5) x the
    bandwidth-delay product in packets (rate / 8 x (delay + jitter) / `MTU_BYTES`; the nominal
    10 Gbit/s when the profile has no rate), at least netem's default of 1,000 (tc-netem(8), "limit").
    Raises nothing."""
    if profile.limit_packets is not None:
        return profile.limit_packets
    rate = profile.rate_bps or NOMINAL_LINE_RATE_BPS
    bdp_packets = rate / 8 * (profile.delay_ms + profile.jitter_ms) / 1000 / MTU_BYTES
    return max(NETEM_DEFAULT_LIMIT, math.ceil(NETEM_LIMIT_HEADROOM * bdp_packets))


def tbf_limit_bytes(profile: LinkProfile) -> int:
    """tbf's queue in bytes (tc-tbf(8), "limit"): limit_packets full frames (`FRAME_BYTES`) when the
    profile sets it and has no netem child, else `TBF_QUEUE_S` (100 ms) of the rate plus the burst.

    Raises:
        LinkShapingError: the profile has no rate (tbf is a rate limiter).
    """
    if profile.rate_bps is None:
        raise LinkShapingError(f"link profile {profile.name!r}: tbf needs a rate; this profile has none")
    if profile.limit_packets is not None and not profile.needs_netem:
        return profile.limit_packets * FRAME_BYTES
    return math.ceil(profile.rate_bps / 8 * TBF_QUEUE_S) + burst_bytes(profile.rate_bps)


def htb_quantum_bytes(rate_bps: int) -> int:
    """htb's quantum in bytes for a rate in bit/s: rate / 8 / r2q (10, tc-htb(8)), clamped to one frame
    (`FRAME_BYTES`) .. `HTB_MAX_QUANTUM_BYTES` (above it net/sched/sch_htb.c warns). Raises nothing."""
    return min(max(rate_bps // 8 // 10, FRAME_BYTES), HTB_MAX_QUANTUM_BYTES)


def netem_args(profile: LinkProfile) -> list[str]:
    """The options after ``netem`` (tc-netem(8)), in its order: ``limit`` packets, ``delay`` and jitter
    in whole microseconds [``distribution``], ``reorder`` percent [correlation] [``gap`` packets],
    ``loss`` [``random``] percent [correlation] or ``loss gemodel p r 1-h 1-k`` (percent), ``duplicate``
    percent [correlation]. Raises nothing."""
    args = ["limit", str(netem_limit_packets(profile))]
    if profile.delay_ms > 0:
        args += ["delay", _us(profile.delay_ms)]
        if profile.jitter_ms > 0:
            args.append(_us(profile.jitter_ms))
            if profile.jitter_distribution not in (None, "uniform"):
                args += ["distribution", profile.jitter_distribution]
    if profile.reorder_pct > 0:
        args += ["reorder", _pct_arg(profile.reorder_pct)]
        if profile.reorder_corr_pct > 0:
            args.append(_pct_arg(profile.reorder_corr_pct))
        if profile.reorder_gap is not None:
            args += ["gap", str(profile.reorder_gap)]
    if profile.loss_pct > 0:
        args += ["loss", _pct_arg(profile.loss_pct)]
        if profile.loss_corr_pct > 0:
            args.append(_pct_arg(profile.loss_corr_pct))
    if profile.loss_gemodel_pct is not None:
        args += ["loss", "gemodel", *(_pct_arg(v) for v in profile.loss_gemodel_pct)]
    if profile.duplicate_pct > 0:
        args += ["duplicate", _pct_arg(profile.duplicate_pct)]
        if profile.duplicate_corr_pct > 0:
            args.append(_pct_arg(profile.duplicate_corr_pct))
    return args


def tree_commands(profile: LinkProfile, dev: str = DEFAULT_DEV) -> list[list[str]]:
    """The qdisc tree of one interface, root first (``replace``, so it also works over a default qdisc).

    With a rate: ``htb`` root (handle 1:) with class 1:1 at the rate, or a ``tbf`` root (handle 1:,
    whose one class is 1:1); netem (handle 10:) under 1:1 when the profile has delay or loss, else
    for htb with limit_packets a ``pfifo`` of that many packets. Without a rate: netem at the root.
    Rates are written in bit/s (``100000000bit``), sizes in bytes (``50000b``). Raises nothing.
    """
    base = ["tc", "qdisc", "replace", "dev", dev]
    if profile.rate_bps is None:
        return [[*base, "root", "handle", "10:", "netem", *netem_args(profile)]]
    rate, burst = f"{profile.rate_bps}bit", f"{burst_bytes(profile.rate_bps)}b"
    if profile.root_qdisc == "htb":
        commands = [
            [*base, "root", "handle", "1:", "htb", "default", "1"],
            ["tc", "class", "replace", "dev", dev, "parent", "1:", "classid", "1:1", "htb", "rate", rate,
             "ceil", rate, "burst", burst, "cburst", burst, "quantum", str(htb_quantum_bytes(profile.rate_bps))],
        ]
    else:
        commands = [[*base, "root", "handle", "1:", "tbf", "rate", rate, "burst", burst,
                     "limit", f"{tbf_limit_bytes(profile)}b"]]
    if profile.needs_netem:
        commands.append([*base, "parent", "1:1", "handle", "10:", "netem", *netem_args(profile)])
    elif profile.root_qdisc == "htb" and profile.limit_packets is not None:
        commands.append([*base, "parent", "1:1", "handle", "10:", "pfifo", "limit", str(profile.limit_packets)])
    return commands


def ingress_commands(dev: str = DEFAULT_DEV, ifb: str = IFB_DEV) -> list[list[str]]:
    """Redirect `dev`'s ingress to a new ifb device `ifb` (the tree then goes on the ifb's egress):
    ``ip link add``, its txqueuelen (`IFB_TXQUEUELEN` packets), the ingress qdisc (handle ffff:) and a
    u32 match-all filter with a mirred redirect (tc-mirred(8)). Raises nothing."""
    return [
        ["ip", "link", "add", ifb, "type", "ifb"],
        # ifb's default queue is 32 packets, and htb's leaf takes the device's; 1000 as on veth
        ["ip", "link", "set", "dev", ifb, "txqueuelen", str(IFB_TXQUEUELEN), "up"],
        ["tc", "qdisc", "replace", "dev", dev, "handle", "ffff:", "ingress"],
        ["tc", "filter", "add", "dev", dev, "parent", "ffff:", "protocol", "all", "u32", "match", "u32", "0", "0",
         "action", "mirred", "egress", "redirect", "dev", ifb],
    ]


def reset_commands(dev: str = DEFAULT_DEV, ifb: str = IFB_DEV) -> list[list[str]]:
    """Undo whatever `profile_commands` set up on `dev` (root and ingress qdiscs, the ifb device), so a
    container shaped before can be shaped again from scratch. Each command fails harmlessly when there
    is nothing to remove (run them without checking). Raises nothing."""
    return [["tc", "qdisc", "del", "dev", dev, "root"], ["tc", "qdisc", "del", "dev", dev, "ingress"],
            ["ip", "link", "del", ifb]]


def profile_commands(profile: LinkProfile, dev: str = DEFAULT_DEV) -> list[list[str]]:
    """Every command for `profile` on `dev`, in order: the egress tree, then (with ingress) the ifb
    redirect and the same tree on `IFB_DEV`. Raises nothing."""
    commands = tree_commands(profile, dev)
    if profile.ingress:
        commands += ingress_commands(dev) + tree_commands(profile, IFB_DEV)
    return commands


def shaped_devices(profile: LinkProfile | None, dev: str = DEFAULT_DEV) -> list[str]:
    """The interfaces `profile` puts qdiscs on (to read back): `dev`, and `IFB_DEV` with ingress."""
    return [dev, IFB_DEV] if profile is not None and profile.ingress else [dev]
