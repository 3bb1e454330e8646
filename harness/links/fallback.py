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
  ``--queue-bypass``, so traffic passes undelayed (fail-open) when no consumer is bound. It also draws
  netem's reorder (a packet accepted at once instead of held, with its correlation and gap) and the
  Gilbert-Elliott loss (``loss_gemodel``: a DROP verdict on arrival) and random loss with a correlation
  (``loss`` + ``loss_correlation``: netem's correlated uniform draw, which ``statistic`` cannot make),
  each as sch_netem.c does;
- ``iptables-tee``: duplication without netem, an ``iptables -m statistic --mode random`` match with the
  ``TEE --gateway 127.0.0.1`` target (xt_TEE) in the mangle table's INPUT, after the delay: the kernel
  clones the packet and routes the clone to the local stack over loopback, so the application's
  socket receives it twice, as from a network that duplicated it (TCP answers with a D-SACK). The
  clone arrives on ``lo``, so no rule of the chains matches it again. With ``duplicate_correlation``
  the delay line draws netem's correlated duplicate and accepts the packet with `DUP_MARK`, and the TEE
  rule matches that mark instead of drawing (mechanism ``delay-line`` for both keys);
- ``unsupported``: nothing this kernel has applies the key (recorded, or the point fails).

Delay and loss are applied on arrival, so a round trip through two shaped containers sees the same
one-way terms as netem on both egresses. With ``ingress: true`` (netem on egress and on the ifb), the
fallback applies each term twice on arrival: two loss rules, two delay draws, two duplicate rules (the
reorder, the Gilbert-Elliott chain and a correlated loss are drawn once).

A link per pair (`harness.links.pairs`) uses the same rules matched on the peer's source address
(``-s PEER/32``) with a chain, a queue and a delay line of its own per peer (`pair_chain`).

Nothing here runs a command; every builder raises nothing unless it says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from harness.links.delayline import DELAY_LINE, stop_argv, wait_ready_argv
from harness.links.tc import netem_limit_packets
from harness.spec.links import LinkProfile

CHAIN = "WIIIIIDE-LINK"  # the fallback's own chain in the mangle table: removing it removes everything
DUP_CHAIN = "WIIIIIDE-DUP"  # the duplicate rules, in mangle INPUT (after the delay line's verdict)
TABLE = "mangle"
QUEUE_NUM = 0  # one queue per container: each container has its own network namespace
TEE_GATEWAY = "127.0.0.1"  # the clone's next hop: the local stack, over loopback
DUP_MARK = 0x10000  # the delay line's mark on a packet to duplicate (a correlated duplicate); the TEE rule matches it
NETEM, STATISTIC, DELAY_LINE_MECHANISM, UNSUPPORTED = "netem", "iptables-statistic", "delay-line", "unsupported"
TEE = "iptables-tee"
# the profile's impairment keys (YAML names; gap goes with reorder)
IMPAIRMENT_KEYS = ("delay", "jitter", "loss", "loss_correlation", "loss_gemodel", "reorder", "reorder_correlation",
                   "duplicate", "duplicate_correlation")
_IN_DELAY_LINE = ("delay", "jitter", "loss_gemodel", "reorder", "reorder_correlation")


@dataclass(frozen=True)
class FallbackCapabilities:
    """What a kernel without netem offers the fallback: the iptables ``statistic`` match (with a DROP
    target) and the ``NFQUEUE`` target with a bound consumer (the delay line's binary present)."""

    statistic: bool
    nfqueue: bool
    tee: bool = False  # the TEE target (xt_TEE, nf_dup_ipv4) in the mangle table


def choose_mechanisms(profile: LinkProfile, netem: bool, fallback: FallbackCapabilities) -> dict[str, str]:
    """The mechanism of each impairment key the profile sets (`IMPAIRMENT_KEYS`, YAML names) on a kernel
    with (`netem`) or without netem, e.g. ``{"delay": "delay-line", "loss": "iptables-statistic"}``.
    A key set to 0 is absent. Without netem: delay, jitter, reorder (and its correlation and gap) and
    the Gilbert-Elliott loss go to the delay line (``caps.nfqueue``), random loss to ``statistic``, or,
    with a correlation, loss and its correlation to the delay line (``statistic`` draws each packet on its
    own; with no delay line, the loss goes to ``statistic`` and its correlation is ``unsupported``);
    duplicate to ``TEE`` (``caps.tee``), or, with a correlation, duplicate and its correlation to the delay
    line (which marks the packets the TEE rule clones: it needs ``caps.tee`` too). Raises nothing."""
    asked = {"delay": profile.delay_ms > 0, "jitter": profile.jitter_ms > 0, "loss": profile.loss_pct > 0,
             "loss_correlation": profile.loss_corr_pct > 0, "loss_gemodel": profile.loss_gemodel_pct is not None,
             "reorder": profile.reorder_pct > 0, "reorder_correlation": profile.reorder_corr_pct > 0,
             "duplicate": profile.duplicate_pct > 0, "duplicate_correlation": profile.duplicate_corr_pct > 0}
    if netem:
        return {key: NETEM for key, on in asked.items() if on}
    by_kind = {**{key: (DELAY_LINE_MECHANISM, fallback.nfqueue) for key in _IN_DELAY_LINE},
               "loss": (STATISTIC, fallback.statistic), "duplicate": (TEE, fallback.tee and fallback.statistic)}
    if asked["loss_correlation"] and fallback.nfqueue:
        by_kind["loss"] = by_kind["loss_correlation"] = (DELAY_LINE_MECHANISM, fallback.nfqueue)
    if asked["duplicate_correlation"] and fallback.nfqueue and fallback.tee:
        by_kind["duplicate"] = by_kind["duplicate_correlation"] = (DELAY_LINE_MECHANISM, True)
    out = {}
    for key, on in asked.items():
        if on:
            how, present = by_kind.get(key, (UNSUPPORTED, False))
            out[key] = how if present else UNSUPPORTED
    return out


_REORDER_OFF = {"reorder_pct": 0.0, "reorder_corr_pct": 0.0, "reorder_gap": None}
# per key: the field changes that leave it out of a profile (a reorder needs its delay: it goes with it)
_OFF: dict[str, dict[str, Any]] = {
    "delay": {"delay_ms": 0.0, "jitter_ms": 0.0, "jitter_distribution": None, **_REORDER_OFF},
    "jitter": {"jitter_ms": 0.0, "jitter_distribution": None}, "loss": {"loss_pct": 0.0, "loss_corr_pct": 0.0},
    "loss_correlation": {"loss_corr_pct": 0.0}, "loss_gemodel": {"loss_gemodel_pct": None}, "reorder": _REORDER_OFF,
    "reorder_correlation": {"reorder_corr_pct": 0.0},
    "duplicate": {"duplicate_pct": 0.0, "duplicate_corr_pct": 0.0}, "duplicate_correlation": {"duplicate_corr_pct": 0.0}}


def _asked(profile: LinkProfile, key: str) -> str:
    if key in ("delay", "jitter"):
        return f"{key} {getattr(profile, key + '_ms'):g} ms"
    if key == "loss_gemodel":
        return "loss gemodel " + " ".join(f"{name} {v:g} %" for name, v in zip(("p", "r", "1-h", "1-k"),
                                                                                profile.loss_gemodel_pct or ()))
    field = {"loss": "loss_pct", "loss_correlation": "loss_corr_pct", "reorder": "reorder_pct",
             "reorder_correlation": "reorder_corr_pct", "duplicate": "duplicate_pct",
             "duplicate_correlation": "duplicate_corr_pct"}[key]
    return f"{key.replace('_', ' ')} {getattr(profile, field):g} %"


def missing_parts(profile: LinkProfile, mechanisms: dict[str, str]) -> tuple[list[str], dict[str, Any]]:
    """The keys `mechanisms` (`choose_mechanisms`) marks ``unsupported``: their text for a message
    (``["loss correlation 25 %"]``; a correlation is not named when its key is missing too) and the field
    changes (`LinkProfile.replace`) that leave them out. Raises nothing."""
    missing = [key for key, how in mechanisms.items() if how == UNSUPPORTED]
    asked = [_asked(profile, key) for key in missing
             if not (key.endswith("_correlation") and key.removesuffix("_correlation") in missing)]
    if "delay" in missing and "reorder" not in missing and profile.reorder_pct:
        asked.append(f"{_asked(profile, 'reorder')} (it needs the delay)")
    changes: dict[str, Any] = {}
    for key in missing:
        changes.update(_OFF[key])
    return asked, changes


def uses_delay_line(mechanisms: dict[str, str]) -> bool:
    """Whether any key of `mechanisms` (`choose_mechanisms`) is applied by the delay line."""
    return DELAY_LINE_MECHANISM in mechanisms.values()


def fallback_chains(mechanisms: dict[str, str], chain: str = CHAIN,
                    dup_chain: str = DUP_CHAIN) -> tuple[str | None, str | None]:
    """Which of the two chains `rule_commands` installs for `mechanisms`: ``(chain or None, dup_chain or
    None)``, for the counters' read-back. Raises nothing."""
    main = mechanisms.get("loss") == STATISTIC or uses_delay_line(mechanisms)
    dup = mechanisms.get("duplicate") in (TEE, DELAY_LINE_MECHANISM)
    return (chain if main else None), (dup_chain if dup else None)


def pair_chain(minor: int) -> tuple[str, str, int]:
    """The chain, duplicate chain and queue number of the pair class `minor` (`harness.links.pairs`):
    ``("WIIIIIDE-LINK-10", "WIIIIIDE-DUP-10", 16)`` for minor 0x10. Raises nothing."""
    return f"{CHAIN}-{minor:x}", f"{DUP_CHAIN}-{minor:x}", minor


def _probability(pct: float) -> str:
    """A percentage as the statistic match's probability (0..1), without float noise."""
    return f"{pct / 100:.8f}".rstrip("0").rstrip(".")


def _ipt(*args: str) -> list[str]:
    return ["iptables", "-w", "-t", TABLE, *args]


def _match(dev: str, source: str | None) -> list[str]:
    return ["-i", dev, *(["-s", f"{source}/32"] if source else [])]


def rule_commands(profile: LinkProfile, mechanisms: dict[str, str], dev: str = "eth0",
                  queue_num: int = QUEUE_NUM, source: str | None = None, chain: str = CHAIN,
                  dup_chain: str = DUP_CHAIN) -> list[list[str]]:
    """The iptables argv lists that install the fallback's rules for the packets arriving on `dev` (from
    `source` alone, an IPv4 address, for a pair's link): the chain `chain` in the mangle table, a jump to
    it from PREROUTING, a counting rule (every packet seen), one random DROP per direction asked (two
    with ``ingress``) when loss is ``iptables-statistic``, and an ``NFQUEUE --queue-num N
    --queue-bypass`` when a key is ``delay-line``, followed by the delay line's own start
    (`delay_line_argv`, run detached: `harness.links.delayline.runs_in_background`) and its wait until
    bound, before the jump. A duplicate (``iptables-tee``) gets `dup_chain`, jumped to from INPUT: a
    counting rule and one ``statistic`` + ``TEE`` rule per direction, or, when the delay line draws a
    correlated duplicate, one ``TEE`` rule matching `DUP_MARK`. Empty when nothing applies."""
    loss = mechanisms.get("loss") == STATISTIC
    delay = uses_delay_line(mechanisms)
    duplicate = mechanisms.get("duplicate") == TEE
    marked = mechanisms.get("duplicate") == DELAY_LINE_MECHANISM
    directions = 2 if profile.ingress else 1
    commands: list[list[str]] = []
    if loss or delay:
        commands += [_ipt("-N", chain), _ipt("-A", chain, "-m", "comment", "--comment", "seen")]
        if loss:
            commands += [_ipt("-A", chain, "-m", "statistic", "--mode", "random", "--probability",
                              _probability(profile.loss_pct), "-m", "comment", "--comment", "loss", "-j", "DROP")
                         for _ in range(directions)]
        if delay:
            commands.append(_ipt("-A", chain, "-j", "NFQUEUE", "--queue-num", str(queue_num), "--queue-bypass"))
            commands += [delay_line_argv(profile, queue_num), wait_ready_argv(queue_num=queue_num)]
        commands.append(_ipt("-I", "PREROUTING", "1", *_match(dev, source), "-j", chain))
    if duplicate or marked:
        commands += [_ipt("-N", dup_chain), _ipt("-A", dup_chain, "-m", "comment", "--comment", "seen")]
        if marked:  # the delay line drew it (correlated): one clone per marked packet
            commands.append(_ipt("-A", dup_chain, "-m", "mark", "--mark", f"{DUP_MARK:#x}/{DUP_MARK:#x}", "-m",
                                 "comment", "--comment", "duplicate", "-j", "TEE", "--gateway", TEE_GATEWAY))
        else:
            commands += [_ipt("-A", dup_chain, "-m", "statistic", "--mode", "random", "--probability",
                              _probability(profile.duplicate_pct), "-m", "comment", "--comment", "duplicate",
                              "-j", "TEE", "--gateway", TEE_GATEWAY) for _ in range(directions)]
        commands.append(_ipt("-I", "INPUT", "1", *_match(dev, source), "-j", dup_chain))
    return commands


def rule_reset_commands(dev: str = "eth0", queue_num: int = QUEUE_NUM, source: str | None = None,
                        chain: str = CHAIN, dup_chain: str = DUP_CHAIN) -> list[list[str]]:
    """Undo `rule_commands` (the jumps, then the delay line, which accepts what it still holds, then the
    chains' rules and the chains); each fails harmlessly when there is nothing to remove (run them
    without checking)."""
    return [_ipt("-D", "PREROUTING", *_match(dev, source), "-j", chain),
            _ipt("-D", "INPUT", *_match(dev, source), "-j", dup_chain), stop_argv(queue_num),
            _ipt("-F", chain), _ipt("-X", chain), _ipt("-F", dup_chain), _ipt("-X", dup_chain)]


def rule_counters_command(chain: str = CHAIN) -> list[str]:
    """The read-back of a chain's counters: ``iptables -t mangle -L WIIIIIDE-LINK -v -x -n``."""
    return _ipt("-L", chain, "-v", "-x", "-n")


def parse_rule_counters(text: str) -> dict[str, Any]:
    """A fallback chain's listing (`rule_counters_command`) -> ``{"seen_packets", "dropped_packets",
    "loss_pct"}``: the counting rule's packets, the sum over the DROP rules, and dropped / seen in percent
    (None before any packet); for the duplicate chain also ``duplicated_packets`` (the TEE rules' sum)
    and ``duplicate_pct``. Lines that are not rules (the header) are skipped.

    Raises:
        ValueError: a rule line whose counters are not whole numbers.
    """
    seen = dropped = duplicated = 0
    tee = False
    for line in text.splitlines():
        words = line.split()
        if len(words) < 3 or not words[0].isdigit():
            continue
        packets = int(words[0])
        if words[2] == "DROP":
            dropped += packets
        elif words[2] == "TEE":
            tee, duplicated = True, duplicated + packets
        elif "seen" in words:
            seen = packets
    out: dict[str, Any] = {"seen_packets": seen, "dropped_packets": dropped,
                           "loss_pct": round(100 * dropped / seen, 6) if seen else None}
    if tee:
        out.update(duplicated_packets=duplicated, duplicate_pct=round(100 * duplicated / seen, 6) if seen else None)
    return out


def delay_line_argv(profile: LinkProfile, queue_num: int = QUEUE_NUM, limit_packets: int | None = None) -> list[str]:
    """The delay line's command line: queue `queue_num`, the one-way delay and jitter in whole
    microseconds, netem's distribution name (uniform when unset), the number of draws per packet (2 with
    ``ingress``, see the module docstring) and its queue's length in packets (`limit_packets`, by default
    netem's limit for the profile, `harness.links.tc.netem_limit_packets`: 1.5 x the bandwidth-delay
    product, at least 1,000); then netem's reorder (``--reorder-pct``, ``--reorder-corr-pct``, ``--gap``)
    and Gilbert-Elliott loss (``--ge-p-pct`` .. ``--ge-1k-pct``) or a correlated random loss (``--loss-pct``,
    ``--loss-corr-pct``: only with a correlation; without one, loss is an iptables rule) and a correlated
    duplicate (``--duplicate-pct``, ``--duplicate-corr-pct``, ``--dup-mark``) where the profile sets them.
    Raises nothing."""
    limit_packets = netem_limit_packets(profile) if limit_packets is None else limit_packets
    argv = [DELAY_LINE, "--queue", str(queue_num), "--delay-us", str(round(profile.delay_ms * 1000)),
            "--jitter-us", str(round(profile.jitter_ms * 1000)),
            "--distribution", profile.jitter_distribution or "uniform",
            "--draws", "2" if profile.ingress else "1", "--max-len", str(limit_packets)]
    if profile.reorder_pct > 0:
        argv += ["--reorder-pct", _pct_text(profile.reorder_pct)]
        argv += ["--reorder-corr-pct", _pct_text(profile.reorder_corr_pct)] if profile.reorder_corr_pct else []
        argv += ["--gap", str(profile.reorder_gap)] if profile.reorder_gap is not None else []
    if profile.loss_gemodel_pct is not None:
        for flag, pct in zip(("--ge-p-pct", "--ge-r-pct", "--ge-1h-pct", "--ge-1k-pct"), profile.loss_gemodel_pct):
            argv += [flag, _pct_text(pct)]
    if profile.loss_pct > 0 and profile.loss_corr_pct > 0:
        argv += ["--loss-pct", _pct_text(profile.loss_pct), "--loss-corr-pct", _pct_text(profile.loss_corr_pct)]
    if profile.duplicate_pct > 0 and profile.duplicate_corr_pct > 0:
        argv += ["--duplicate-pct", _pct_text(profile.duplicate_pct),
                 "--duplicate-corr-pct", _pct_text(profile.duplicate_corr_pct), "--dup-mark", str(DUP_MARK)]
    return argv


def _pct_text(pct: float) -> str:
    """A percentage as the delay line reads it (``25``, ``0.5``), without float noise."""
    return f"{pct:.6f}".rstrip("0").rstrip(".")
