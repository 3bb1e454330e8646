"""What netem's per-packet impairments should give, and what a receiver saw: the model values of the
Gilbert-Elliott loss and of the reorder with its gap, and the counts read off the sequence numbers a
receiver got in arrival order (pure; `harness.bench.link_impair` measures with them).

Gilbert-Elliott (tc-netem(8), ``loss gemodel p r 1-h 1-k``; netem's ``loss_gilb_ell`` in
net/sched/sch_netem.c): a two-state Markov chain, good -> bad with probability p, bad -> good with r,
a packet lost with 1-k in the good state and 1-h in the bad one, the loss drawn in the state the packet
finds. Its stationary state probabilities are pi_B = p / (p + r) and pi_G = r / (p + r), so the mean
loss rate is pi_G (1-k) + pi_B (1-h); in the simple Gilbert case (1-h = 1, 1-k = 0) a loss burst is a
stay in the bad state, of mean length 1 / r packets (G. Hasslinger and O. Hohlfeld, "The
Gilbert-Elliott Model for Packet Loss in Real Time Services on the Internet", MMB 2008, section 2; the
netem model is S. Salsano, F. Ludovici, A. Ordine, "Definition of a general and intuitive loss model
for packet networks and its implementation in the Netem module in the Linux kernel", 2009). In
general the mean length of a run of lost packets is P(lost) / P(lost, then not lost), both from the
stationary chain (a run ends once per lost packet followed by one that is not).

Correlated random loss (tc-netem(8), ``loss random P C``; netem's ``loss_event`` with ``get_crandom``): a
packet is lost when P >= x_n, x_n = (1 - C) u_n + C x_{n-1} with u_n uniform in [0, 1), an AR(1) filter of
uniform draws. Its mean stays 1/2 but its spread narrows as C grows, so for P < 1/2 the loss rate falls
below P (and the losses come in runs): the rate is P(x <= P) under the filter's stationary law, which has
no closed form. `correlated_draw_model` draws the filter itself. netem's duplicate with a correlation
is the same draw. For bursts of a chosen length, netem has the Gilbert-Elliott and 4-state models
(Salsano et al. above).

Reorder (netem_enqueue): once gap - 1 packets have been delayed since the last reordered one, each
packet goes out at once with probability P; a cycle is gap - 1 packets plus a geometric number of
mean 1 / P, one reordered per cycle, so the reordered fraction is P / (1 + (gap - 1) P) (renewal
reward; gap 1: P). Without correlation only: a correlated draw changes the run structure.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import numpy as np
from scipy.signal import lfilter


def gemodel_stationary(p: float, r: float, one_minus_h: float, one_minus_k: float) -> dict[str, float]:
    """The Gilbert-Elliott chain's stationary values (probabilities in 0..1, see the module doc):
    ``bad_state_probability`` (pi_B), ``loss_rate`` (pi_G (1-k) + pi_B (1-h)) and
    ``mean_burst_packets`` (mean run of lost packets; 1 / r for 1-h = 1, 1-k = 0).

    Raises:
        ValueError: a probability outside [0, 1], or p + r = 0 (no stationary distribution), or a
        chain that never loses a packet (no burst length).
    """
    for name, value in (("p", p), ("r", r), ("1-h", one_minus_h), ("1-k", one_minus_k)):
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"gemodel {name} = {value!r}; allowed: a probability in [0, 1]")
    if p + r == 0:
        raise ValueError("gemodel p + r = 0: the chain stays in its first state (no stationary distribution)")
    pi_b = p / (p + r)
    pi_g = 1.0 - pi_b
    loss = pi_g * one_minus_k + pi_b * one_minus_h
    # P(lost at n, not lost at n+1): the state moves after the packet's draw
    ends = (pi_g * one_minus_k * ((1 - p) * (1 - one_minus_k) + p * (1 - one_minus_h))
            + pi_b * one_minus_h * (r * (1 - one_minus_k) + (1 - r) * (1 - one_minus_h)))
    if loss == 0 or ends == 0:
        raise ValueError("this gemodel loses no packet, or every one: no burst length")
    return {"bad_state_probability": pi_b, "loss_rate": loss, "mean_burst_packets": loss / ends}


def correlated_draw_model(loss: float, correlation: float, draws: int = 2_000_000, seed: int = 0) -> dict[str, float]:
    """netem's correlated draw ``P >= get_crandom()``, drawn: the share of packets it picks and the mean run
    of picked packets, for a loss (or a duplicate: netem draws both so) of `loss` (0..1) when `correlation`
    (0..1) ties each uniform draw to the last (the module doc),
    over `draws` packets of the filter from a fixed `seed` (the filter starts at its mean, 1/2, and the first
    1,000 draws are left out). Returns ``loss_rate`` (0..1) and ``mean_burst_packets`` (None without loss).

    Raises:
        ValueError: `loss` or `correlation` outside [0, 1], or fewer than 10,000 draws.
    """
    if not (0.0 <= loss <= 1.0 and 0.0 <= correlation <= 1.0) or draws < 10_000:
        raise ValueError(f"loss {loss!r}, correlation {correlation!r}, draws {draws!r}; allowed: probabilities "
                         "in [0, 1] and at least 10000 draws")
    u = np.random.default_rng(seed).random(draws + 1000)
    x, _ = lfilter([1.0 - correlation], [1.0, -correlation], u, zi=[correlation * 0.5])
    lost = x[1000:] <= loss
    count = int(lost.sum())
    # a run ends at each lost packet followed by a kept one (or at the end)
    ends = int(np.count_nonzero(lost[:-1] & ~lost[1:])) + int(lost[-1])
    return {"loss_rate": count / draws, "mean_burst_packets": (count / ends) if ends else None}


def reorder_fraction(probability: float, gap: int = 1) -> float:
    """netem's reordered fraction for reorder `probability` (0..1) and `gap` packets, without
    correlation: P / (1 + (gap - 1) P) (see the module doc).

    Raises:
        ValueError: a probability outside [0, 1] or a gap < 1.
    """
    if not 0.0 <= probability <= 1.0 or gap < 1:
        raise ValueError(f"reorder {probability!r} gap {gap!r}; allowed: a probability in [0, 1], gap >= 1")
    return probability / (1 + (gap - 1) * probability)


def loss_runs(received: Iterable[int], sent: int) -> list[int]:
    """The lengths of the runs of consecutive sequence numbers in 0 .. `sent` - 1 not in `received`."""
    got = set(received)
    runs, current = [], 0
    for seq in range(sent):
        if seq in got:
            if current:
                runs.append(current)
            current = 0
        else:
            current += 1
    if current:
        runs.append(current)
    return runs


def early_count(arrivals: Sequence[int]) -> int:
    """How many packets (first copies, in arrival order) arrived before some packet sent earlier: a
    packet sent out at once by a reorder overtakes those still held for their delay."""
    firsts, seen = [], set()
    for seq in arrivals:
        if seq not in seen:
            seen.add(seq)
            firsts.append(seq)
    count, suffix_min = 0, None
    for seq in reversed(firsts):
        if suffix_min is not None and seq > suffix_min:
            count += 1
        suffix_min = seq if suffix_min is None else min(suffix_min, seq)
    return count


def arrival_stats(arrivals: Sequence[int], sent: int) -> dict[str, Any]:
    """What a receiver saw of `sent` numbered datagrams (0 .. sent - 1), `arrivals` in arrival order
    (copies included): ``received_datagrams`` (distinct), ``duplicates`` (copies beyond the first),
    ``duplicate_pct`` (duplicates / distinct, in percent), ``lost_datagrams``, ``loss_pct``,
    ``loss_bursts`` and ``mean_burst_packets`` (runs of consecutive lost numbers; None without loss),
    ``early_datagrams`` and ``early_pct`` (`early_count` over the distinct ones).

    Raises:
        ValueError: a sequence number outside 0 .. sent - 1.
    """
    if any(not 0 <= seq < sent for seq in arrivals):
        raise ValueError(f"a sequence number outside 0..{sent - 1}")
    distinct = len(set(arrivals))
    runs = loss_runs(arrivals, sent)
    early = early_count(arrivals)
    return {"sent_datagrams": sent, "received_datagrams": distinct, "duplicates": len(arrivals) - distinct,
            "duplicate_pct": round(100 * (len(arrivals) - distinct) / distinct, 6) if distinct else None,
            "lost_datagrams": sent - distinct, "loss_pct": round(100 * (sent - distinct) / sent, 6) if sent else None,
            "loss_bursts": len(runs), "mean_burst_packets": round(sum(runs) / len(runs), 4) if runs else None,
            "early_datagrams": early, "early_pct": round(100 * early / distinct, 6) if distinct else None}
