"""bench-wire's targets, computed from the raw values a bench-wire report keeps.

- uncompressed frames of 1 MiB and up at >= 0.90x the raw socket (`FRAMES_TARGET_VS_RAW`);
- on each paced link, ``network-aware`` within 5 % of the best fixed codec (`WITHIN_BEST_FIXED`) and
  faster than ``seed``.
"""

from __future__ import annotations

from typing import Any

from wiiide.units import MIB

FRAMES_TARGET_VS_RAW = 0.90
FRAMES_TARGET_FROM_BYTES = MIB
WITHIN_BEST_FIXED = 1.05


def rate_key(rate_bps: float | None) -> str:
    """A link rate as the summary's key: bit/s as an integer string, ``unpaced`` for None or 0."""
    return str(int(rate_bps)) if rate_bps else "unpaced"


def _links_at(links: list[dict[str, Any]], rate_bps: float) -> dict[str, Any] | None:
    rows = [r for r in links if (r["rate_bps"] or 0) == rate_bps]
    median = {r["policy"]: r["message_s_median"] for r in rows}
    fixed = {p: t for p, t in median.items() if p.startswith("fixed:")}
    if not fixed or "network-aware" not in median:
        return None
    best = min(fixed, key=fixed.get)
    na = median["network-aware"]
    # the 25th percentile: what each policy costs when other work on the machine leaves it alone
    p25 = {r["policy"]: r.get("message_s_p25") for r in rows}
    fixed25 = {p: t for p, t in p25.items() if p.startswith("fixed:") and t}
    best25 = min(fixed25, key=fixed25.get) if fixed25 else None
    seed = median.get("seed")
    return {
        "network_aware_vs_best_fixed_p25": (p25["network-aware"] / fixed25[best25]
                                            if best25 and p25.get("network-aware") else None),
        "best_fixed": best, "best_fixed_s": fixed[best], "network_aware_s": na,
        "network_aware_vs_best_fixed": na / fixed[best], "seed_s": seed,
        "network_aware_vs_seed": na / seed if seed else None,
        "within_5pct_of_best_fixed": na <= WITHIN_BEST_FIXED * fixed[best],
        "beats_seed": seed is not None and na < seed,
    }


def summarize(report: dict[str, Any]) -> dict[str, Any]:
    """The targets from `report`'s ``frames`` and ``links`` rows (either may be missing or empty).

    Returns:
        ``uncompressed_frames_vs_raw_from_1MiB`` (size in bytes as a string -> median frame / raw ratio
        of codec ``none``; raw = the fastest raw variant), ``uncompressed_frames_target_0_90_met`` (bool),
        ``uncompressed_frames_vs_iperf3_from_1MiB`` (the same against iperf3; empty without it), and ``links``: per rate
        (`rate_key`) with fixed policies and ``network-aware``, the best fixed policy and its median
        seconds per round trip, network-aware's, their ratio (also at the 25th percentile), the ratio to
        ``seed``, ``within_5pct_of_best_fixed`` and ``beats_seed``.

    Raises:
        KeyError: a row without the fields `frames_section` / `links_section` write.
    """
    frames = report.get("frames", [])
    big = [r for r in frames if r["size_bytes"] >= FRAMES_TARGET_FROM_BYTES and "none" in r["frames"]]
    none_ratios = {str(r["size_bytes"]): r["frames"]["none"]["vs_raw"] for r in big}
    vs_iperf3 = {str(r["size_bytes"]): r["frames"]["none"]["vs_iperf3"] for r in big
                 if "vs_iperf3" in r["frames"]["none"]}
    links = report.get("links", [])
    per_rate = {}
    for rate in sorted({r["rate_bps"] or 0 for r in links}):
        entry = _links_at(links, rate)
        if entry is not None:
            per_rate[rate_key(rate)] = entry
    return {
        "uncompressed_frames_vs_raw_from_1MiB": none_ratios,
        "uncompressed_frames_target_0_90_met": bool(none_ratios) and min(none_ratios.values()) >= FRAMES_TARGET_VS_RAW,
        "uncompressed_frames_vs_iperf3_from_1MiB": vs_iperf3,
        "links": per_rate,
    }
