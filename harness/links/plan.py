"""The shaping plan: a link profile turned into tc commands for what this kernel has (netem, tbf, htb,
ifb), with the parts it cannot apply listed as unsupported, or `LinkShapingError` unless
``allow_partial`` is set; and the plan's record, with its one-line summary (`describe`), as the report
stores it per container.

Capabilities differ between kernels: `harness.run.tc_exec.probe_capabilities` tries netem, tbf, htb
and ifb in a throwaway container, and `plan_shaping` turns a profile into commands for what this kernel
has. A missing part is never silently dropped: it fails the point, or (``allow_partial``) the rest is
applied and the missing part is listed as unsupported.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

from harness.errors import LinkShapingError
from harness.links.fallback import UNSUPPORTED, FallbackCapabilities, choose_mechanisms, missing_parts, rule_commands
from harness.links.tc import DEFAULT_DEV, profile_commands, shaped_devices
from harness.spec.links import LinkProfile
from wiiide.units import format_rate


@dataclass(frozen=True)
class Capabilities:
    """Which qdisc kinds this kernel has. `errors` keeps tc's message for each missing one."""

    netem: bool
    tbf: bool
    htb: bool
    ifb: bool
    errors: Mapping[str, str] = dataclasses.field(default_factory=dict)
    statistic: bool = False  # iptables' statistic match with DROP, in the node image (harness.links.fallback)
    nfqueue: bool = False  # the NFQUEUE target and the delay line's consumer in the node image
    tee: bool = False  # the TEE target (xt_TEE) in the mangle table: duplication without netem

    def has(self, kind: str) -> bool:
        """Whether the kernel has `kind` (``netem``, ``tbf``, ``htb`` or ``ifb``).

        Raises:
            AttributeError: `kind` is none of those.
        """
        return bool(getattr(self, kind))

    def to_dict(self) -> dict[str, Any]:
        """The report's ``capabilities`` record: one bool per kind and tc's message for each missing one."""
        return {"netem": self.netem, "tbf": self.tbf, "htb": self.htb, "ifb": self.ifb,
                "statistic": self.statistic, "nfqueue": self.nfqueue, "tee": self.tee, "errors": dict(self.errors)}

    @property
    def fallback(self) -> FallbackCapabilities:
        """What the fallback without netem can use (`harness.links.fallback`)."""
        return FallbackCapabilities(statistic=self.statistic, nfqueue=self.nfqueue, tee=self.tee)


ALL_CAPABILITIES = Capabilities(netem=True, tbf=True, htb=True, ifb=True)


def describe(profile: LinkProfile | None) -> str:
    """What `profile` does in one line for people, as Mininet's summary of a link, e.g. ``100Mbit (htb)
    20ms delay 2ms normal jitter 1% loss, egress``; ``not shaped`` for None. It is the plan's
    ``summary`` in the report and the progress line of each shaped container. Raises nothing."""
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
    if profile.reorder_pct:
        gap = f" gap {profile.reorder_gap}" if profile.reorder_gap is not None else ""
        parts.append(f"{profile.reorder_pct:g}% reorder{gap}")
    if profile.loss_gemodel_pct is not None:
        parts.append("gemodel loss (p {:g}% r {:g}% 1-h {:g}% 1-k {:g}%)".format(*profile.loss_gemodel_pct))
    if profile.duplicate_pct:
        parts.append(f"{profile.duplicate_pct:g}% duplicate")
    if profile.limit_packets is not None:
        parts.append(f"limit {profile.limit_packets}p")
    return " ".join(parts) + (", both directions (ingress via ifb)" if profile.ingress else ", egress")


@dataclass(frozen=True)
class ShapingPlan:
    """What will be applied to one container: the profile asked for, the part this kernel can do, the
    commands, the devices to read back and what is not applied (each with why)."""

    requested: LinkProfile | None
    applied: LinkProfile | None
    commands: tuple[tuple[str, ...], ...]
    devices: tuple[str, ...]
    unsupported: tuple[str, ...]
    mechanisms: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """The report's record of the plan: ``requested`` and ``applied_profile`` (profile dicts or None),
        ``summary`` (`describe` of what is applied), ``commands`` (argv lists) and ``unsupported``."""
        return {"requested": self.requested.to_dict() if self.requested else None,
                "applied_profile": self.applied.to_dict() if self.applied else None,
                "summary": describe(self.applied), "commands": [list(c) for c in self.commands],
                "unsupported": list(self.unsupported), "mechanisms": dict(self.mechanisms)}


def _missing(caps: Capabilities, kind: str) -> str:
    why = caps.errors.get(kind)
    return f"this kernel has no {kind}" + (f" (tc: {why})" if why else "")


def plan_shaping(profile: LinkProfile | None, caps: Capabilities, allow_partial: bool = False,
                 dev: str = DEFAULT_DEV) -> ShapingPlan:
    """The commands for `profile` given what the kernel has.

    Raises:
        LinkShapingError: the profile needs netem, ifb or its root qdisc and the kernel lacks it, and
        `allow_partial` is false. With `allow_partial`, the missing parts are left out and listed.

    Without netem, each impairment key takes the mechanism `harness.links.fallback.choose_mechanisms`
    gives it from ``caps.statistic`` and ``caps.nfqueue``: its iptables rules follow the tc commands,
    and the plan's ``mechanisms`` records which one applies each key (``netem`` where the kernel has it).
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

    mechanisms = choose_mechanisms(profile, caps.netem, caps.fallback)
    fallback_commands: list[list[str]] = []
    if profile.needs_netem and not caps.netem:
        asked, kept = missing_parts(profile, mechanisms)
        if asked:
            drop(", ".join(asked), "netem")
        mechanisms = {key: how for key, how in mechanisms.items() if how != UNSUPPORTED}
        fallback_commands = rule_commands(profile, mechanisms, dev)
        # the applied profile keeps what the fallback applies; tc gets its rate part alone (tc_part below)
        applied = profile.replace(**kept) if fallback_commands else profile.without_netem()
    if applied is not None and applied.rate_bps is not None and not caps.has(applied.root_qdisc):
        drop(f"rate {format_rate(applied.rate_bps)} ({applied.root_qdisc})", applied.root_qdisc)
        applied = None if not applied.needs_netem else applied.replace(rate_bps=None)
    if applied is not None and applied.ingress and not caps.ifb:
        drop("ingress shaping (ifb)", "ifb")
        applied = applied.replace(ingress=False)
    tc_part = applied.without_netem() if applied is not None and fallback_commands else applied
    commands = tuple(tuple(c) for c in [*(profile_commands(tc_part, dev) if tc_part is not None else []),
                                        *fallback_commands])
    return ShapingPlan(profile, applied, commands, tuple(shaped_devices(tc_part, dev)), tuple(unsupported),
                       mechanisms)
