"""Pure builders of the tc commands that change a shaped link while training, and the check of a
changing profile (`harness.spec.timeline.TimedProfile`) against what the kernel has.

The tree a profile's first step built (`harness.links.tc.tree_commands`, or a pair's class,
`harness.links.pairs`) stays; each later step changes it in place, so no packet queued at the change
is dropped and no connection sees a missing qdisc:

- a rate under htb: ``tc class change dev D parent 1: classid 1:1 htb rate R ceil R burst B cburst B
  quantum Q`` (the burst and quantum of the new rate, as the tree sizes them);
- a rate under tbf: ``tc qdisc change dev D root handle 1: tbf rate R burst B limit L``;
- a delay, jitter or loss: ``tc qdisc change dev D parent 1:1 handle 10: netem ...`` (netem at the
  root when the profile has no rate). netem is there from the first step whenever some step needs it
  (`TimedProfile.needs_netem`); on a kernel without netem these steps cannot be applied
  (`check_timeline`).

With ``ingress: true`` every change is made on the ifb device too. Nothing here runs a command.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from harness.errors import LinkShapingError
from harness.links.plan import Capabilities, ShapingPlan, plan_shaping
from harness.links.tc import (
    DEFAULT_DEV,
    IFB_DEV,
    burst_bytes,
    htb_quantum_bytes,
    netem_args,
    tbf_limit_bytes,
)
from harness.spec.links import LinkProfile
from harness.spec.timeline import NETEM_FIELDS, TimedProfile

RATE_FIELD = "rate_bps"


def htb_class_args(rate_bps: int) -> list[str]:
    """An htb class's options at `rate_bps`: rate = ceil, the burst of `harness.links.tc.burst_bytes`
    and the quantum of `htb_quantum_bytes`. Raises nothing."""
    rate, burst = f"{rate_bps}bit", f"{burst_bytes(rate_bps)}b"
    return ["htb", "rate", rate, "ceil", rate, "burst", burst, "cburst", burst,
            "quantum", str(htb_quantum_bytes(rate_bps))]


def change_commands(profile: LinkProfile, changed: set[str], dev: str = DEFAULT_DEV,
                    classid: str = "1:1", netem_handle: str = "10:") -> list[list[str]]:
    """The commands that bring the tree on `dev` to `profile` (the profile in force after a step) where
    `changed` (field names) differ: the rate class (or tbf) for ``rate_bps``, netem for the delay,
    jitter or loss fields. `classid` and `netem_handle` name the class and its netem child (a pair's
    own, `harness.links.pairs`). With ``profile.ingress`` the same on `IFB_DEV` follows. Empty when
    nothing tc applies changed.

    Raises:
        LinkShapingError: a rate change on a profile without a rate (no class to change).
    """
    commands: list[list[str]] = []
    for device in ([dev, IFB_DEV] if profile.ingress else [dev]):
        if RATE_FIELD in changed:
            if profile.rate_bps is None:
                raise LinkShapingError(f"link profile {profile.name!r}: a rate change but no rate class to change")
            if profile.root_qdisc == "tbf":
                commands.append(["tc", "qdisc", "change", "dev", device, "root", "handle", "1:", "tbf", "rate",
                                 f"{profile.rate_bps}bit", "burst", f"{burst_bytes(profile.rate_bps)}b",
                                 "limit", f"{tbf_limit_bytes(profile)}b"])
            else:
                commands.append(["tc", "class", "change", "dev", device, "parent", "1:", "classid", classid,
                                 *htb_class_args(profile.rate_bps)])
        if changed & set(NETEM_FIELDS):
            where = ["parent", classid] if profile.rate_bps is not None else ["root"]
            commands.append(["tc", "qdisc", "change", "dev", device, *where, "handle", netem_handle, "netem",
                             *netem_args(profile)])
    return commands


def profile_after(profile: LinkProfile, changes: dict[str, Any]) -> LinkProfile:
    """`profile` with one step's `changes` (field -> value) applied, as a plain `LinkProfile`.

    Raises:
        SpecError: the result is not a valid profile (checked when the spec loaded, so only for a
        timeline made in Python).
    """
    fields = {k: v for k, v in profile.model_dump().items() if k in LinkProfile.model_fields}
    return LinkProfile(**{**fields, **changes})


def check_timeline(profile: TimedProfile, netem: bool, allow_partial: bool) -> tuple[TimedProfile, list[str]]:
    """The timeline this kernel can apply and what it cannot: later steps of delay, jitter or loss need
    netem; without it they are dropped (listed, with ``allow_partial``) or refused.

    Returns ``(profile, unsupported)``: `profile` without the changes the kernel cannot make.

    Raises:
        LinkShapingError: a step needs netem, the kernel has none and `allow_partial` is false.
    """
    netem_changes = profile.changed_fields() & set(NETEM_FIELDS)
    if not netem_changes or netem:
        return profile, []
    names = ", ".join(sorted(f.removesuffix("_ms").removesuffix("_pct") for f in netem_changes))
    what = f"a {profile.source} that changes {names} while training"
    if not allow_partial:
        raise LinkShapingError(f"link profile {profile.name!r}: {what} needs netem (tc qdisc change ... netem) and "
                               f"this kernel has none; set allow_partial: true to change the rate alone")
    return profile.without_changes_of(netem_changes), [f"{what}: this kernel has no netem"]


def plan_timed_shaping(profile: LinkProfile | None, caps: Capabilities, allow_partial: bool = False) -> ShapingPlan:
    """`harness.links.plan.plan_shaping` for a profile that may change while training: the changes
    this kernel cannot make are dropped first (`check_timeline`) and listed with the plan's
    ``unsupported``; any other profile goes to `plan_shaping` as it is.

    Raises:
        LinkShapingError: as `plan_shaping` and `check_timeline`.
    """
    missing: list[str] = []
    if isinstance(profile, TimedProfile):
        profile, missing = check_timeline(profile, caps.netem, allow_partial)
    plan = plan_shaping(profile, caps, allow_partial)
    return dataclasses.replace(plan, unsupported=(*plan.unsupported, *missing)) if missing else plan
