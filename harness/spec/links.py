"""Link profiles: one frozen value object per link's conditions (rate, delay, jitter, loss, queue limit),
validated when built, after Pumba's one value object per network effect (alexei-led/pumba).

Raises `harness.errors.SpecError` for a value out of range; the tc commands that realise a profile are
built by `harness.links.tc`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

from harness.errors import SpecError
from wiiide.units import UnitError, parse_pct, parse_rate_bps, parse_time_ms

ROOT_QDISCS = ("htb", "tbf")


DISTRIBUTIONS = ("uniform", "normal", "pareto", "paretonormal")


MAX_RATE_BPS = 100 * 10**9


MAX_DELAY_MS = 60_000.0


MAX_LIMIT_PACKETS = 10_000_000


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
        except (SpecError, UnitError) as exc:
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
