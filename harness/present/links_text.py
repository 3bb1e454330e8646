"""Report text of the links stage's results: the rate applied per container, what could not be applied,
and the parameter server's egress as a share of the link (the links columns of the report table).
"""

from __future__ import annotations

from typing import Any, Mapping

from wiiide.units import format_rate


def applied_rates_text(links: Mapping[str, Any]) -> str:
    """The egress rates in force, compactly: ``100Mbit`` when every container has the same, else by
    container (``ps 100Mbit, w1 1Gbit, w2 1Gbit``); ``-`` when nothing limits the rate."""
    records = sorted((links.get("containers") or {}).values(),
                     key=lambda r: (r.get("role") != "coordinator", r.get("worker_index") or 0))
    if not records:
        return "-"
    if links.get("pairs"):  # links by pair: the rates in force over the pairs, lowest first
        rates = sorted({p.get("rate_bps") for p in links["pairs"].values() if p.get("rate_bps")})
        return "pairs " + "/".join(format_rate(rate) for rate in rates) if rates else "pairs -"
    rates = [(("ps" if r.get("role") == "coordinator" else f"w{r.get('worker_index')}"), r.get("applied_rate_bps"))
             for r in records]
    if len({rate for _, rate in rates}) == 1:
        text = format_rate(rates[0][1])
    else:
        text = ", ".join(f"{who} {format_rate(rate)}" for who, rate in rates)
    if any(r.get("applied_profile") and r["applied_profile"].get("ingress") for r in records):
        text += " (+ingress)"
    changes = max((len(r.get("timeline_changes") or []) for r in records), default=0)
    if changes:  # a schedule or a trace: the last rate it set, or how many changes a trace made
        last = [c for r in records for c in (r.get("timeline_changes") or [])[-1:] if "rate_bps" in c.get("changes", {})]
        text += (f" -> {format_rate(last[0]['changes']['rate_bps'])}" if changes == 1 and last
                 else f" ({changes} changes)")
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
