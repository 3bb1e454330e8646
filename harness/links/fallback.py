"""Where a kernel has no netem: which mechanism applies each impairment key of a link profile, and the
pure argv builders of the in-kernel loss rules and of the delay line's command line.

Mechanisms (one per profile key, chosen from a probed `Capabilities`):

- ``netem``: delay, jitter, loss (and its correlation) in the netem qdisc, wherever the kernel has it;
- ``iptables-statistic``: random loss without netem, an ``iptables -m statistic --mode random`` DROP
  in the container's own namespace on the packets it *receives* (mangle PREROUTING on `dev`). A DROP
  on OUTPUT would make the sender's own send fail (EPERM) instead of a loss TCP recovers from. The
  rule before it counts every packet seen, so the loss read back is the mechanism's own count
  (dropped / seen). As netem's loss, it drops whole packets as the kernel carries them (a TSO/GRO
  segment of up to 64 KB counts as one);
- ``delay-line``: delay and jitter without netem, an NFQUEUE consumer in the container's namespace
  holding each received packet for its delay (`delay_line_argv`); the rule queues with
  ``--queue-bypass``, so traffic passes undelayed (fail-open) when no consumer is bound;
- ``unsupported``: nothing this kernel has applies the key (recorded, or the point fails).

Delay and loss are applied on arrival, so a round trip through two shaped containers sees the same
one-way terms as netem on both egresses. With ``ingress: true`` (netem on egress and on the ifb), the
fallback applies each term twice on arrival: two loss rules, two delay draws.

Nothing here runs a command; every builder raises nothing unless it says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from harness.links.delayline import DELAY_LINE, stop_argv, wait_ready_argv
from harness.links.tc import netem_limit_packets
from harness.spec.links import LinkProfile

CHAIN = "WIIIIIDE-LINK"  # the fallback's own chain in the mangle table: removing it removes everything
TABLE = "mangle"
QUEUE_NUM = 0  # one queue per container: each container has its own network namespace
NETEM, STATISTIC, DELAY_LINE_MECHANISM, UNSUPPORTED = "netem", "iptables-statistic", "delay-line", "unsupported"
IMPAIRMENT_KEYS = ("delay", "jitter", "loss", "loss_correlation")


@dataclass(frozen=True)
class FallbackCapabilities:
    """What a kernel without netem offers the fallback: the iptables ``statistic`` match (with a DROP
    target) and the ``NFQUEUE`` target with a bound consumer (the delay line's binary present)."""

    statistic: bool
    nfqueue: bool


def choose_mechanisms(profile: LinkProfile, netem: bool, fallback: FallbackCapabilities) -> dict[str, str]:
    """The mechanism of each impairment key the profile sets (`IMPAIRMENT_KEYS`, YAML names) on a kernel
    with (`netem`) or without netem, e.g. ``{"delay": "delay-line", "loss": "iptables-statistic"}``.
    A key set to 0 is absent. Loss correlation has no fallback (``statistic`` draws each packet on its
    own): it is ``unsupported`` without netem. Raises nothing."""
    asked = {"delay": profile.delay_ms > 0, "jitter": profile.jitter_ms > 0, "loss": profile.loss_pct > 0,
             "loss_correlation": profile.loss_corr_pct > 0}
    if netem:
        return {key: NETEM for key, on in asked.items() if on}
    without = {"delay": fallback.nfqueue, "jitter": fallback.nfqueue, "loss": fallback.statistic,
               "loss_correlation": False}
    by_kind = {"delay": DELAY_LINE_MECHANISM, "jitter": DELAY_LINE_MECHANISM, "loss": STATISTIC}
    return {key: by_kind[key] if without[key] else UNSUPPORTED for key, on in asked.items() if on}


def _probability(pct: float) -> str:
    """A percentage as the statistic match's probability (0..1), without float noise."""
    return f"{pct / 100:.8f}".rstrip("0").rstrip(".")


def _ipt(*args: str) -> list[str]:
    return ["iptables", "-w", "-t", TABLE, *args]


def rule_commands(profile: LinkProfile, mechanisms: dict[str, str], dev: str = "eth0",
                  queue_num: int = QUEUE_NUM) -> list[list[str]]:
    """The iptables argv lists that install the fallback's rules for the packets arriving on `dev`: the
    chain `CHAIN` in the mangle table, a jump to it from PREROUTING, a counting rule (every packet seen),
    one random DROP per direction asked (two with ``ingress``) when loss is ``iptables-statistic``, and an
    ``NFQUEUE --queue-num N --queue-bypass`` when delay is ``delay-line``, followed by the delay line's own
    start (`delay_line_argv`, run detached: `harness.links.delayline.runs_in_background`) and its wait
    until bound, before the jump. Empty when neither applies."""
    loss = mechanisms.get("loss") == STATISTIC
    delay = DELAY_LINE_MECHANISM in (mechanisms.get("delay"), mechanisms.get("jitter"))
    if not (loss or delay):
        return []
    commands = [_ipt("-N", CHAIN), _ipt("-A", CHAIN, "-m", "comment", "--comment", "seen")]
    if loss:
        for _ in range(2 if profile.ingress else 1):
            commands.append(_ipt("-A", CHAIN, "-m", "statistic", "--mode", "random", "--probability",
                                 _probability(profile.loss_pct), "-m", "comment", "--comment", "loss", "-j", "DROP"))
    if delay:
        commands.append(_ipt("-A", CHAIN, "-j", "NFQUEUE", "--queue-num", str(queue_num), "--queue-bypass"))
        commands += [delay_line_argv(profile, queue_num), wait_ready_argv()]
    commands.append(_ipt("-I", "PREROUTING", "1", "-i", dev, "-j", CHAIN))
    return commands


def rule_reset_commands(dev: str = "eth0") -> list[list[str]]:
    """Undo `rule_commands` (the jump, then the delay line, which accepts what it still holds, then the
    chain's rules and the chain); each fails harmlessly when there is nothing to remove (run them without
    checking)."""
    return [_ipt("-D", "PREROUTING", "-i", dev, "-j", CHAIN), stop_argv(), _ipt("-F", CHAIN), _ipt("-X", CHAIN)]


def rule_counters_command() -> list[str]:
    """The read-back of the chain's counters: ``iptables -t mangle -L WIIIIIDE-LINK -v -x -n``."""
    return _ipt("-L", CHAIN, "-v", "-x", "-n")


def parse_rule_counters(text: str) -> dict[str, Any]:
    """The fallback chain's listing (`rule_counters_command`) -> ``{"seen_packets", "dropped_packets",
    "loss_pct"}``: the counting rule's packets, the sum over the DROP rules, and dropped / seen in percent
    (None before any packet). Lines that are not rules (the header) are skipped.

    Raises:
        ValueError: a rule line whose counters are not whole numbers.
    """
    seen = dropped = 0
    for line in text.splitlines():
        words = line.split()
        if len(words) < 3 or not words[0].isdigit():
            continue
        packets = int(words[0])
        if words[2] == "DROP":
            dropped += packets
        elif "seen" in words:
            seen = packets
    return {"seen_packets": seen, "dropped_packets": dropped,
            "loss_pct": round(100 * dropped / seen, 6) if seen else None}


def delay_line_argv(profile: LinkProfile, queue_num: int = QUEUE_NUM, limit_packets: int | None = None) -> list[str]:
    """The delay line's command line: queue `queue_num`, the one-way delay and jitter in whole
    microseconds, netem's distribution name (uniform when unset), the number of draws per packet (2 with
    ``ingress``, see the module docstring) and its queue's length in packets (`limit_packets`, by default
    netem's limit for the profile, `harness.links.tc.netem_limit_packets`: 1.5 x the bandwidth-delay
    product, at least 1,000). Raises nothing."""
    limit_packets = netem_limit_packets(profile) if limit_packets is None else limit_packets
    return [DELAY_LINE, "--queue", str(queue_num), "--delay-us", str(round(profile.delay_ms * 1000)),
            "--jitter-us", str(round(profile.jitter_ms * 1000)),
            "--distribution", profile.jitter_distribution or "uniform",
            "--draws", "2" if profile.ingress else "1", "--max-len", str(limit_packets)]
