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

import dataclasses
import math
import re
import shlex
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from harness.errors import LinkShapingError, SpecError

DEFAULT_DEV = "eth0"  # the one interface of a container on one Compose network
IFB_DEV = "ifb0"  # made inside the container's network namespace; it goes with the namespace
IFB_TXQUEUELEN = 1000
ROOT_QDISCS = ("htb", "tbf")
DISTRIBUTIONS = ("uniform", "normal", "pareto", "paretonormal")
KERNEL_HZ = 250  # CONFIG_HZ of these machines' kernel; a smaller HZ would need a bigger burst
MIN_BURST_BYTES = 16 * 1024
TBF_QUEUE_S = 0.1  # tbf's queue: 100 ms of the rate (plus the burst)
MTU_BYTES = 1500
FRAME_BYTES = 1514  # MTU plus the Ethernet header, as qdiscs count packets
NETEM_DEFAULT_LIMIT = 1000  # packets, netem's own default
NETEM_LIMIT_HEADROOM = 1.5
NOMINAL_LINE_RATE_BPS = 10 * 10**9  # for netem's limit when a profile sets no rate (veth: ~9 Gbit/s here)
HTB_MAX_QUANTUM_BYTES = 200_000  # above this htb warns "quantum of class is big"
MAX_RATE_BPS = 100 * 10**9
MAX_DELAY_MS = 60_000.0
MAX_LIMIT_PACKETS = 10_000_000

# --------------------------------------------------------------------------------------------
# units


_RATE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(bit|bps)(/s)?\s*$", re.IGNORECASE)
_SI = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_TIME_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(us|ms|s)\s*$", re.IGNORECASE)
_TIME_MS = {"us": 1e-3, "ms": 1.0, "s": 1000.0}
_PCT_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*%?\s*$")


def parse_rate_bps(value: Any, field: str = "rate") -> int:
    """``"100mbit"``, ``"1Gbit/s"``, ``"500kbit"`` -> bit/s (SI: k = 1,000, as tc reads them).

    Raises:
        SpecError: a bare number (ambiguous), tc's byte units (``mbps`` means MB/s to tc) or anything else.
    """
    if isinstance(value, bool) or isinstance(value, (int, float)):
        raise SpecError(f"{field}: {value!r} needs a unit: e.g. 100mbit, 1gbit, 500kbit (bit/s, k = 1000)")
    match = _RATE_RE.match(str(value))
    if not match:
        raise SpecError(f"{field}: {value!r} is not a rate: write e.g. 100mbit, 1gbit, 500kbit (bit/s, k = 1000)")
    number, prefix, unit, _ = match.groups()
    if unit.lower() == "bps":
        raise SpecError(f"{field}: {value!r} is ambiguous (tc reads 'bps' as bytes per second); "
                        f"write bits: e.g. {number}{prefix}bit")
    return int(round(float(number) * _SI[prefix.lower()]))


def parse_time_ms(value: Any, field: str) -> float:
    """``"20ms"``, ``"500us"``, ``"1.5s"`` -> milliseconds. Raises SpecError for a bare number or a bad unit."""
    if isinstance(value, bool) or isinstance(value, (int, float)):
        raise SpecError(f"{field}: {value!r} needs a unit: e.g. 20ms, 500us, 1s")
    match = _TIME_RE.match(str(value))
    if not match:
        raise SpecError(f"{field}: {value!r} is not a time: write e.g. 20ms, 500us, 1s")
    return float(match.group(1)) * _TIME_MS[match.group(2).lower()]


def parse_pct(value: Any, field: str) -> float:
    """``1``, ``0.5``, ``"1%"`` -> percent. Raises SpecError for anything else."""
    if isinstance(value, bool):
        raise SpecError(f"{field}: {value!r} is not a percentage")
    if isinstance(value, (int, float)):
        return float(value)
    match = _PCT_RE.match(str(value))
    if not match:
        raise SpecError(f"{field}: {value!r} is not a percentage: write e.g. 1% or 0.5")
    return float(match.group(1))


def format_rate(rate_bps: float | None) -> str:
    """100_000_000 -> ``"100Mbit"`` (as tc prints rates)."""
    if rate_bps is None:
        return "-"
    for prefix, factor in (("T", 10**12), ("G", 10**9), ("M", 10**6), ("K", 10**3)):
        if rate_bps >= factor:
            return f"{rate_bps / factor:g}{prefix}bit"
    return f"{rate_bps:g}bit"


def _us(ms: float) -> str:
    """Milliseconds as a tc time argument in whole microseconds (exact, never '1e-05ms')."""
    return f"{int(round(ms * 1000))}us"


def _pct_arg(pct: float) -> str:
    return f"{pct:.6f}".rstrip("0").rstrip(".") + "%"


# --------------------------------------------------------------------------------------------
# the value object

# YAML key -> (field, parser)
PROFILE_KEYS = {
    "rate": "rate_bps", "delay": "delay_ms", "jitter": "jitter_ms", "distribution": "jitter_distribution",
    "loss": "loss_pct", "loss_correlation": "loss_corr_pct", "limit_packets": "limit_packets",
    "ingress": "ingress", "qdisc": "root_qdisc",
}


@dataclass(frozen=True)
class LinkProfile:
    """What one container's link does to its traffic. Units are in the field names.

    rate_bps: the rate class at the root (None: no rate limit). delay_ms, jitter_ms,
    jitter_distribution (None: uniform, netem's draw without a table), loss_pct and loss_corr_pct
    (0..100): netem. limit_packets: netem's queue (None: from the bandwidth-delay product); with a
    rate and no netem, the rate class's queue. ingress: shape traffic coming in too, through ifb.
    root_qdisc: ``htb`` (a rate class, as Mininet) or ``tbf``.

    Raises:
        SpecError: naming the field, when a value is out of range (jitter > delay, loss outside
        0..100, rate <= 0) or the profile does nothing.
    """

    name: str = "inline"
    rate_bps: int | None = None
    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    jitter_distribution: str | None = None
    loss_pct: float = 0.0
    loss_corr_pct: float = 0.0
    limit_packets: int | None = None
    ingress: bool = False
    root_qdisc: str = "htb"

    def __post_init__(self) -> None:
        def check(ok: bool, field: str, message: str) -> None:
            if not ok:
                raise SpecError(f"link profile {self.name!r}: {field}: {message}")

        r, d, j = self.rate_bps, self.delay_ms, self.jitter_ms
        check(r is None or (isinstance(r, int) and not isinstance(r, bool) and 1000 <= r <= MAX_RATE_BPS),
              "rate", f"{r!r} must be 1kbit..100gbit")
        check(isinstance(d, (int, float)) and 0 <= d <= MAX_DELAY_MS, "delay", f"{d!r} ms must be 0..60000 ms")
        check(isinstance(j, (int, float)) and 0 <= j, "jitter", f"{j!r} ms must be >= 0")
        check(j <= d, "jitter", f"{j:g} ms must be <= delay ({d:g} ms)")
        check(self.jitter_distribution is None or self.jitter_distribution in DISTRIBUTIONS, "distribution",
              f"{self.jitter_distribution!r}; allowed: {' | '.join(DISTRIBUTIONS)}")
        check(self.jitter_distribution is None or j > 0, "distribution", "needs a jitter > 0")
        for field, value in (("loss", self.loss_pct), ("loss_correlation", self.loss_corr_pct)):
            check(isinstance(value, (int, float)) and 0 <= value <= 100, field, f"{value!r} % must be 0..100")
        check(self.loss_corr_pct == 0 or self.loss_pct > 0, "loss_correlation", "needs a loss > 0")
        n = self.limit_packets
        check(n is None or (isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= MAX_LIMIT_PACKETS),
              "limit_packets", f"{n!r} must be 1..{MAX_LIMIT_PACKETS}")
        check(isinstance(self.ingress, bool), "ingress", f"{self.ingress!r} must be true or false")
        check(self.root_qdisc in ROOT_QDISCS, "qdisc", f"{self.root_qdisc!r}; allowed: {' | '.join(ROOT_QDISCS)}")
        check(r is not None or self.needs_netem, "(profile)", "does nothing: set a rate, a delay or a loss")

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], name: str = "inline") -> "LinkProfile":
        """Build from YAML keys: rate (``100mbit``), delay / jitter (``20ms``), distribution, loss and
        loss_correlation (percent), limit_packets, ingress, qdisc. Raises SpecError naming the key."""
        unknown = sorted(set(data) - set(PROFILE_KEYS))
        if unknown:
            raise SpecError(f"link profile {name!r}: {unknown[0]}: unknown key; allowed: {', '.join(PROFILE_KEYS)}")
        values: dict[str, Any] = {"name": name}
        try:
            for key, raw in data.items():
                if key == "rate":
                    values["rate_bps"] = parse_rate_bps(raw, "rate")
                elif key in ("delay", "jitter"):
                    values[PROFILE_KEYS[key]] = parse_time_ms(raw, key)
                elif key in ("loss", "loss_correlation"):
                    values[PROFILE_KEYS[key]] = parse_pct(raw, key)
                else:
                    values[PROFILE_KEYS[key]] = raw
        except SpecError as exc:
            raise SpecError(f"link profile {name!r}: {exc}") from None
        try:
            return cls(**values)
        except SpecError:
            raise
        except (TypeError, ValueError) as exc:  # a wrong type the checks compare against
            raise SpecError(f"link profile {name!r}: {exc}") from None

    @property
    def needs_netem(self) -> bool:
        return self.delay_ms > 0 or self.loss_pct > 0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def without_netem(self) -> "LinkProfile | None":
        """The rate part alone (None when there is no rate)."""
        if self.rate_bps is None:
            return None
        return dataclasses.replace(self, delay_ms=0.0, jitter_ms=0.0, jitter_distribution=None,
                                   loss_pct=0.0, loss_corr_pct=0.0)


# --------------------------------------------------------------------------------------------
# sizes


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


# --------------------------------------------------------------------------------------------
# builders: pure functions returning argv lists


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


# --------------------------------------------------------------------------------------------
# capabilities and plans


@dataclass(frozen=True)
class Capabilities:
    """Which qdisc kinds this kernel has. `errors` keeps tc's message for each missing one."""

    netem: bool
    tbf: bool
    htb: bool
    ifb: bool
    errors: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def has(self, kind: str) -> bool:
        return bool(getattr(self, kind))

    def to_dict(self) -> dict[str, Any]:
        return {"netem": self.netem, "tbf": self.tbf, "htb": self.htb, "ifb": self.ifb, "errors": dict(self.errors)}


ALL_CAPABILITIES = Capabilities(netem=True, tbf=True, htb=True, ifb=True)


@dataclass(frozen=True)
class ShapingPlan:
    """What will be applied to one container: the profile asked for, the part this kernel can do, the
    commands, the devices to read back and what is not applied (each with why)."""

    requested: LinkProfile | None
    applied: LinkProfile | None
    commands: tuple[tuple[str, ...], ...]
    devices: tuple[str, ...]
    unsupported: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"requested": self.requested.to_dict() if self.requested else None,
                "applied_profile": self.applied.to_dict() if self.applied else None,
                "summary": describe(self.applied), "commands": [list(c) for c in self.commands],
                "unsupported": list(self.unsupported)}


def _missing(caps: Capabilities, kind: str) -> str:
    why = caps.errors.get(kind)
    return f"this kernel has no {kind}" + (f" (tc: {why})" if why else "")


def plan_shaping(profile: LinkProfile | None, caps: Capabilities, allow_partial: bool = False,
                 dev: str = DEFAULT_DEV) -> ShapingPlan:
    """The commands for `profile` given what the kernel has.

    Raises:
        LinkShapingError: the profile needs netem, ifb or its root qdisc and the kernel lacks it, and
        `allow_partial` is false. With `allow_partial`, the missing parts are left out and listed.
    """
    if profile is None:
        return ShapingPlan(None, None, (), (dev,), ())
    unsupported: list[str] = []
    applied: LinkProfile | None = profile

    def drop(what: str, kind: str) -> None:
        if not allow_partial:
            raise LinkShapingError(
                f"link profile {profile.name!r} asks for {what} but {_missing(caps, kind)}; set "
                f"allow_partial: true in the link setting to apply the rest and record this as unsupported"
                + (", or run on a kernel with sch_netem" if kind == "netem" else ""))
        unsupported.append(f"{what}: {_missing(caps, kind)}")

    if profile.needs_netem and not caps.netem:
        asked = [f"delay {profile.delay_ms:g} ms"] if profile.delay_ms else []
        asked += [f"jitter {profile.jitter_ms:g} ms"] if profile.jitter_ms else []
        asked += [f"loss {profile.loss_pct:g} %"] if profile.loss_pct else []
        drop(", ".join(asked), "netem")
        applied = profile.without_netem()
    if applied is not None and applied.rate_bps is not None and not caps.has(applied.root_qdisc):
        drop(f"rate {format_rate(applied.rate_bps)} ({applied.root_qdisc})", applied.root_qdisc)
        applied = None if not applied.needs_netem else dataclasses.replace(applied, rate_bps=None)
    if applied is not None and applied.ingress and not caps.ifb:
        drop("ingress shaping (ifb)", "ifb")
        applied = dataclasses.replace(applied, ingress=False)
    commands = tuple(tuple(c) for c in profile_commands(applied, dev)) if applied is not None else ()
    return ShapingPlan(profile, applied, commands, tuple(shaped_devices(applied, dev)), tuple(unsupported))


# --------------------------------------------------------------------------------------------
# reading back: `tc -s qdisc show` and `tc -s class show`

_HEADER_RE = re.compile(r"^(qdisc|class)\s+(\S+)\s+(\S+)\s+(root|parent\s+\S+)(.*)$")
_SENT_RE = re.compile(r"Sent (\d+) bytes (\d+) pkt \(dropped (\d+), overlimits (\d+) requeues (\d+)\)")
_BACKLOG_RE = re.compile(r"backlog (\S+?)b? (\d+)p")
_TC_RATE_RE = re.compile(r"^(\d+(?:\.\d+)?)([KMGT]?)bit$")
_TC_SIZE_RE = re.compile(r"^(\d+(?:\.\d+)?)([KMG]?)b$")
_TC_TIME_RE = re.compile(r"^(\d+(?:\.\d+)?)(us|ms|s)$")
_BINARY = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3}


def tc_rate_bps(text: str) -> int | None:
    """tc's printed rate (``100Mbit``, ``1.5Gbit``, ``800bit``; SI) -> bit/s; None if not a rate."""
    match = _TC_RATE_RE.match(text)
    return int(round(float(match.group(1)) * _SI[match.group(2).lower()])) if match else None


def tc_size_bytes(text: str) -> int | None:
    """tc's printed size (``1600b``, ``16Kb``, ``2Mb``; binary: K = 1024) -> bytes."""
    match = _TC_SIZE_RE.match(text)
    return int(round(float(match.group(1)) * _BINARY[match.group(2)])) if match else None


def tc_time_ms(text: str) -> float | None:
    match = _TC_TIME_RE.match(text)
    return float(match.group(1)) * _TIME_MS[match.group(2)] if match else None


def _options(kind: str, text: str) -> dict[str, Any]:
    """The options we read from a header line's tail (rates, burst, netem's delay and loss)."""
    tokens = text.split()
    out: dict[str, Any] = {}

    def after(i: int) -> str:
        return tokens[i + 1] if i + 1 < len(tokens) else ""

    for i, token in enumerate(tokens):
        if token in ("rate", "ceil") and tc_rate_bps(after(i)) is not None:
            out[f"{token}_bps"] = tc_rate_bps(after(i))
        elif token in ("burst", "cburst") and tc_size_bytes(after(i)) is not None:
            out[f"{token}_bytes"] = tc_size_bytes(after(i))
        elif token == "lat" and tc_time_ms(after(i)) is not None:
            out["latency_ms"] = tc_time_ms(after(i))
        elif token == "limit" and kind != "tbf":
            value = after(i).rstrip("p")
            if value.isdigit():
                out["limit_packets"] = int(value)
        elif token == "delay" and tc_time_ms(after(i)) is not None:
            out["delay_ms"] = tc_time_ms(after(i))
            jitter = tc_time_ms(tokens[i + 2]) if i + 2 < len(tokens) else None
            if jitter is not None:
                out["jitter_ms"] = jitter
        elif token == "loss" and after(i).endswith("%"):
            out["loss_pct"] = float(after(i)[:-1])
            if i + 2 < len(tokens) and tokens[i + 2].endswith("%"):
                out["loss_corr_pct"] = float(tokens[i + 2][:-1])
    return out


def parse_tc_show(text: str) -> list[dict[str, Any]]:
    """Parse ``tc -s qdisc show dev X`` (and ``tc -s class show dev X``) into one dict per qdisc/class.

    Each dict: ``type`` (qdisc|class), ``kind``, ``handle``, ``parent`` ("root" or a handle), the
    options read (``rate_bps``, ``ceil_bps``, ``burst_bytes``, ``limit_packets``, ``delay_ms``,
    ``jitter_ms``, ``loss_pct``, ``loss_corr_pct``, ``latency_ms``) and, with ``-s``, the counters
    ``sent_bytes``, ``sent_packets``, ``drops``, ``overlimits``, ``requeues``, ``backlog_bytes``,
    ``backlog_packets``. Lines it does not know (htb's tokens, lended) are skipped.
    """
    entries: list[dict[str, Any]] = []
    for line in text.splitlines():
        header = _HEADER_RE.match(line.strip())
        if header:
            type_, kind, handle, where, rest = header.groups()
            parent = "root" if where == "root" else where.split()[1]
            entries.append({"type": type_, "kind": kind, "handle": handle, "parent": parent, **_options(kind, rest)})
            continue
        if not entries:
            continue
        sent = _SENT_RE.search(line)
        if sent:
            keys = ("sent_bytes", "sent_packets", "drops", "overlimits", "requeues")
            entries[-1].update(dict(zip(keys, map(int, sent.groups()))))
            continue
        backlog = _BACKLOG_RE.search(line)
        if backlog and "backlog_bytes" not in entries[-1]:
            entries[-1]["backlog_bytes"] = tc_size_bytes(backlog.group(1) + "b")
            entries[-1]["backlog_packets"] = int(backlog.group(2))
    return entries


def rate_in_force_bps(entries: Iterable[Mapping[str, Any]]) -> int | None:
    """The lowest rate of a rate-limiting qdisc or class in a readback (None when nothing limits)."""
    rates = [e["rate_bps"] for e in entries if e.get("rate_bps") and e.get("kind") in ROOT_QDISCS]
    return min(rates) if rates else None


def read_commands(dev: str) -> list[list[str]]:
    return [["tc", "-s", "qdisc", "show", "dev", dev], ["tc", "-s", "class", "show", "dev", dev]]


# --------------------------------------------------------------------------------------------
# running: a thin layer over `docker exec` (no shell)


class TcCommandError(LinkShapingError):
    """A command run in a container failed: `argv`, `exit_code` and the tool's own `tool_message`."""

    def __init__(self, message: str, argv: list[str], exit_code: int | None, tool_message: str) -> None:
        super().__init__(message)
        self.argv, self.exit_code, self.tool_message = argv, exit_code, tool_message


class ContainerExec:
    """Runs argv lists in a running container through the Engine API (``exec_run``, no shell).

    `container` is a docker SDK container (or anything with ``name`` and ``exec_run(argv, demux=True)``).
    """

    def __init__(self, container) -> None:
        self.container = container

    def run(self, argv: Iterable[str]) -> str:
        """Run `argv`; return its stdout.

        Raises:
            LinkShapingError: with the container, the command and tc's own message, when it exits
            non-zero or the container cannot run it (e.g. it has exited).
        """
        argv = list(argv)
        where = getattr(self.container, "name", "container")
        try:
            code, output = self.container.exec_run(argv, demux=True)
        except Exception as exc:  # docker.errors.APIError and friends: the container is not running
            raise TcCommandError(f"{where}: `{shlex.join(argv)}` could not run: {exc}", argv, None, str(exc)) from None
        out, err = output if isinstance(output, tuple) else (output, b"")
        stdout = (out or b"").decode(errors="replace")
        if code != 0:
            message = ((err or b"").decode(errors="replace").strip() or stdout.strip() or "no message")
            raise TcCommandError(f"{where}: `{shlex.join(argv)}` failed (exit {code}): {message}", argv, code, message)
        return stdout


def read_back(runner: ContainerExec, devices: Iterable[str]) -> dict[str, list[dict[str, Any]]]:
    """``{dev: [qdiscs..., classes...]}`` parsed from ``tc -s qdisc/class show`` in the container."""
    return {dev: [e for argv in read_commands(dev) for e in parse_tc_show(runner.run(argv))] for dev in devices}


def apply_plan(runner: ContainerExec, plan: ShapingPlan) -> dict[str, list[dict[str, Any]]]:
    """Run the plan's commands in order, then read back every shaped device.

    Raises LinkShapingError (command and tc's message) at the first command that fails.
    """
    for argv in plan.commands:
        runner.run(argv)
    return read_back(runner, plan.devices)


# --------------------------------------------------------------------------------------------
# the probe: which qdisc kinds this kernel has

PROBE_DEV = "lo"  # the probe container has no network: only its own loopback
PROBE_IFB = "ifbprobe"
PROBES: dict[str, list[list[str]]] = {
    "netem": [["tc", "qdisc", "add", "dev", PROBE_DEV, "root", "handle", "1:", "netem", "delay", "1ms"]],
    "tbf": [["tc", "qdisc", "add", "dev", PROBE_DEV, "root", "handle", "1:", "tbf", "rate", "1mbit",
             "burst", "16kb", "limit", "32kb"]],
    "htb": [["tc", "qdisc", "add", "dev", PROBE_DEV, "root", "handle", "1:", "htb", "default", "1"],
            ["tc", "class", "add", "dev", PROBE_DEV, "parent", "1:", "classid", "1:1", "htb", "rate", "1mbit"]],
    "ifb": ingress_commands(PROBE_DEV, PROBE_IFB),
}
PROBE_CLEANUP = [["tc", "qdisc", "del", "dev", PROBE_DEV, "root"], ["tc", "qdisc", "del", "dev", PROBE_DEV, "ingress"],
                 ["ip", "link", "del", PROBE_IFB]]


def probe_with(runner: ContainerExec) -> Capabilities:
    """Try each qdisc kind on the container's loopback; a kind is present when all its commands work."""
    found: dict[str, bool] = {}
    errors: dict[str, str] = {}
    for kind, commands in PROBES.items():
        try:
            for argv in commands:
                runner.run(argv)
            found[kind] = True
        except TcCommandError as exc:
            found[kind] = False
            errors[kind] = exc.tool_message
        for argv in PROBE_CLEANUP:
            try:
                runner.run(argv)
            except TcCommandError:
                pass  # nothing of that kind was left to remove
    return Capabilities(errors=errors, **found)


_probe_cache: dict[str, Capabilities] = {}


def probe_capabilities(client, image: str, labels: Mapping[str, str] | None = None) -> Capabilities:
    """What this kernel has, tried in a throwaway container of `image` (NET_ADMIN, no network); cached
    per image id for the life of the process (once per sweep).

    Raises:
        LinkShapingError: the probe container cannot be started.
    """
    try:
        image_id = client.images.get(image).id
    except Exception as exc:
        raise LinkShapingError(f"cannot probe the kernel's qdiscs: image {image} not found: {exc}") from None
    if image_id in _probe_cache:
        return _probe_cache[image_id]
    try:
        container = client.containers.run(image, ["sleep", "120"], detach=True, cap_add=["NET_ADMIN"],
                                          network_mode="none", labels=dict(labels or {}))
    except Exception as exc:
        raise LinkShapingError(f"cannot start a probe container of {image}: {exc}") from None
    try:
        caps = probe_with(ContainerExec(container))
    finally:
        container.remove(force=True)
    _probe_cache[image_id] = caps
    return caps


# --------------------------------------------------------------------------------------------
# what the report shows


def _coordinator_record(links: Mapping[str, Any]) -> Mapping[str, Any] | None:
    return next((r for r in (links.get("containers") or {}).values() if r.get("role") == "coordinator"), None)


def link_totals(links: Mapping[str, Any], nodes: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """Per-repeat link figures ({} for an unshaped run).

    link_rate_bps: the rate in force on the coordinator's egress (the parameter server's link; read
    back from tc). coordinator_egress_utilisation: the coordinator's frame bytes sent per second of
    training over that rate; TCP/IP and Ethernet headers are not counted, so a full link reads
    about 0.95 (1448 payload bytes per 1514-byte frame).
    """
    if not links:
        return {}
    record = _coordinator_record(links)
    rate = record.get("applied_rate_bps") if record else None
    coord = nodes.get("coordinator") or {}
    train_s, sent = coord.get("train_time_s"), coord.get("wire_bytes_sent")
    utilisation = sent * 8 / train_s / rate if (rate and train_s and sent is not None) else None
    return {"link_rate_bps": rate, "coordinator_egress_utilisation": utilisation}


def applied_rates_text(links: Mapping[str, Any]) -> str:
    """The egress rates in force, compactly: ``100Mbit`` when every container has the same, else by
    container (``ps 100Mbit, w1 1Gbit, w2 1Gbit``); ``-`` when nothing limits the rate."""
    records = sorted((links.get("containers") or {}).values(),
                     key=lambda r: (r.get("role") != "coordinator", r.get("worker_index") or 0))
    if not records:
        return "-"
    rates = [(("ps" if r.get("role") == "coordinator" else f"w{r.get('worker_index')}"), r.get("applied_rate_bps"))
             for r in records]
    if len({rate for _, rate in rates}) == 1:
        text = format_rate(rates[0][1])
    else:
        text = ", ".join(f"{who} {format_rate(rate)}" for who, rate in rates)
    if any(r.get("applied_profile") and r["applied_profile"].get("ingress") for r in records):
        text += " (+ingress)"
    return text


def unsupported_text(links: Mapping[str, Any]) -> str:
    """What was asked and not applied, once per kind (``delay 20 ms, jitter 2 ms``); ``-`` if nothing."""
    seen: list[str] = []
    for record in (links.get("containers") or {}).values():
        for item in record.get("unsupported") or []:
            what = item.split(": ", 1)[0]
            if what not in seen:
                seen.append(what)
    return "; ".join(seen) or "-"


LINK_COLUMNS = ["rate applied", "not applied", "ps egress %"]


def link_cells(point: Mapping[str, Any]) -> list[str]:
    """A report point's cells under `LINK_COLUMNS`: the rates in force and what was not applied (from
    its first repeat that shaped anything) and the median coordinator egress utilisation."""
    links = next((r["links"] for r in point.get("repeats", []) if (r.get("links") or {}).get("containers")), {})
    utilisation = (point.get("summary") or {}).get("coordinator_egress_utilisation")
    return [applied_rates_text(links) if links else "-", unsupported_text(links) if links else "-",
            f"{100 * utilisation['median']:.0f}" if utilisation else "-"]
