"""Link shaping with tc: one value object per link profile, pure builders of tc argv lists, a parser
of ``tc -s qdisc show`` / ``tc -s class show``, and a thin runner that executes argv lists inside a
container and raises `LinkShapingError` with the command and tc's own message.

The qdisc tree of one interface is built in one go, as Mininet's ``TCIntf.config()`` does
(mininet/link.py): a rate class at the root (htb, or tbf) and netem as its child for delay, jitter
and loss. Without a rate, netem is the root. Ingress shaping redirects the interface's ingress to an
ifb device (``ifb0``, made inside the container's network namespace) and builds the same tree there.
Each profile is one frozen value object validated when built, with pure functions returning the tc
commands (after Pumba's netem commands, alexei-led/pumba), so every command is tested without root
and a dry run shows exactly what would run.

Sizes the tree derives (every one documented where it is computed):

- tbf and htb burst: ``rate / KERNEL_HZ`` bytes, at least `MIN_BURST_BYTES`. A token bucket must hold
  at least one timer tick of traffic (tc-tbf(8)); with 16 KiB at 1 Gbit/s tbf reached only 75 % of
  the rate on this machine, with rate/HZ it reached 95 % (TCP/IP headers are the other 4.4 %).
- netem limit: the bandwidth-delay product in packets, times `NETEM_LIMIT_HEADROOM`, at least netem's
  default of 1,000 packets, which throttles long fat links (tc-netem(8), "limit").
- tbf limit (bytes of queue): `TBF_QUEUE_S` seconds of the rate plus the burst, or
  ``limit_packets`` full-size frames when the profile sets it.

Capabilities differ between kernels: `probe_capabilities` tries netem, tbf, htb and ifb in a throwaway
container, and `plan_shaping` turns a profile into commands for what this kernel has. A profile that
needs a missing qdisc fails with `LinkShapingError` unless ``allow_partial`` is set, in which case the
rest is applied and the missing parts are listed as unsupported, never silently dropped.
"""

from __future__ import annotations

import math

from harness.spec.links import LinkProfile
from wiiide.units import format_rate

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
    return f"{pct:.6f}".rstrip("0").rstrip(".") + "%"


def burst_bytes(rate_bps: int) -> int:
    """Token-bucket burst for tbf and htb: one timer tick of the rate (rate / HZ), at least 16 KiB."""
    return max(math.ceil(rate_bps / 8 / KERNEL_HZ), MIN_BURST_BYTES)


def netem_limit_packets(profile: LinkProfile) -> int:
    """netem's queue in packets: the profile's limit_packets, else 1.5 x the bandwidth-delay product
    (rate x (delay + jitter) / MTU; the nominal 10 Gbit/s when no rate), at least netem's 1,000."""
    if profile.limit_packets is not None:
        return profile.limit_packets
    rate = profile.rate_bps or NOMINAL_LINE_RATE_BPS
    bdp_packets = rate / 8 * (profile.delay_ms + profile.jitter_ms) / 1000 / MTU_BYTES
    return max(NETEM_DEFAULT_LIMIT, math.ceil(NETEM_LIMIT_HEADROOM * bdp_packets))


def tbf_limit_bytes(profile: LinkProfile) -> int:
    """tbf's queue in bytes: limit_packets full frames, else 100 ms of the rate plus the burst."""
    assert profile.rate_bps is not None
    if profile.limit_packets is not None and not profile.needs_netem:
        return profile.limit_packets * FRAME_BYTES
    return math.ceil(profile.rate_bps / 8 * TBF_QUEUE_S) + burst_bytes(profile.rate_bps)


def htb_quantum_bytes(rate_bps: int) -> int:
    """htb's quantum: rate / r2q (10) bytes, clamped to 1 frame .. 200,000 (htb's own warning bound)."""
    return min(max(rate_bps // 8 // 10, FRAME_BYTES), HTB_MAX_QUANTUM_BYTES)


def netem_args(profile: LinkProfile) -> list[str]:
    """The options after ``netem``: limit, delay [jitter [distribution]], loss [correlation]."""
    args = ["limit", str(netem_limit_packets(profile))]
    if profile.delay_ms > 0:
        args += ["delay", _us(profile.delay_ms)]
        if profile.jitter_ms > 0:
            args.append(_us(profile.jitter_ms))
            if profile.jitter_distribution not in (None, "uniform"):
                args += ["distribution", profile.jitter_distribution]
    if profile.loss_pct > 0:
        args += ["loss", _pct_arg(profile.loss_pct)]
        if profile.loss_corr_pct > 0:
            args.append(_pct_arg(profile.loss_corr_pct))
    return args


def tree_commands(profile: LinkProfile, dev: str = DEFAULT_DEV) -> list[list[str]]:
    """The qdisc tree of one interface, root first (``replace``, so it also works over a default qdisc).

    With a rate: ``htb`` root (handle 1:) with class 1:1 at the rate, or a ``tbf`` root (handle 1:,
    whose one class is 1:1); netem (handle 10:) under 1:1 when the profile has delay or loss, else
    for htb with limit_packets a ``pfifo`` of that many packets. Without a rate: netem at the root.
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
    """Redirect `dev`'s ingress to a new ifb device (the tree then goes on the ifb's egress)."""
    return [
        ["ip", "link", "add", ifb, "type", "ifb"],
        # ifb's default queue is 32 packets, and htb's leaf takes the device's; 1000 as on veth
        ["ip", "link", "set", "dev", ifb, "txqueuelen", str(IFB_TXQUEUELEN), "up"],
        ["tc", "qdisc", "replace", "dev", dev, "handle", "ffff:", "ingress"],
        ["tc", "filter", "add", "dev", dev, "parent", "ffff:", "protocol", "all", "u32", "match", "u32", "0", "0",
         "action", "mirred", "egress", "redirect", "dev", ifb],
    ]


def profile_commands(profile: LinkProfile, dev: str = DEFAULT_DEV) -> list[list[str]]:
    """Every command for `profile` on `dev`: the egress tree, then (ingress) the ifb redirect and tree."""
    commands = tree_commands(profile, dev)
    if profile.ingress:
        commands += ingress_commands(dev) + tree_commands(profile, IFB_DEV)
    return commands


def shaped_devices(profile: LinkProfile | None, dev: str = DEFAULT_DEV) -> list[str]:
    return [dev, IFB_DEV] if profile is not None and profile.ingress else [dev]


def describe(profile: LinkProfile | None) -> str:
    """One line for people, as Mininet's summary: ``100Mbit 20ms delay 2ms normal jitter 1% loss``."""
    if profile is None:
        return "not shaped"
    parts = []
    if profile.rate_bps is not None:
        parts.append(f"{format_rate(profile.rate_bps)} ({profile.root_qdisc})")
    if profile.delay_ms:
        parts.append(f"{profile.delay_ms:g}ms delay")
    if profile.jitter_ms:
        parts.append(f"{profile.jitter_ms:g}ms {profile.jitter_distribution or 'uniform'} jitter")
    if profile.loss_pct:
        corr = f" ({profile.loss_corr_pct:g}% correlated)" if profile.loss_corr_pct else ""
        parts.append(f"{profile.loss_pct:g}% loss{corr}")
    if profile.limit_packets is not None:
        parts.append(f"limit {profile.limit_packets}p")
    return " ".join(parts) + (", both directions (ingress via ifb)" if profile.ingress else ", egress")
