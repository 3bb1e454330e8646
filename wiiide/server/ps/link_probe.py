"""The link probe behind ``partitions_per_shard: auto``: how fast the links are, before the plan.

Why pieces follow the link. A shard cuts its range into pieces so that it can answer one while the
next is still arriving (pipelining over the link); every piece costs each node a frame's CPU (encode,
send and receive calls, a decode). Measured with sharded fp32 against DDP fp32 (studies/auto-partitions/; digits 4 / 8 workers, 26 MB 4 / 8 workers):

- unshaped Docker bridge (`results/unshaped-pieces-20261125T080607Z`): 8 pieces per shard 1.19 / 1.49 /
  1.35 / ~0.90x, 2 pieces 1.58 / 1.44 / 1.43 / 1.20x: where a piece crosses the link in less time than
  its frame costs, the pipelining gains less than the frames cost;
- 100 Mbit/s (`results/shaped-pieces-20261125T082614Z`): 8 pieces 1.22 / 1.17 / 1.25x, 2 pieces 1.20 /
  1.13 / ~1.02x, and at 26 MB / 8 workers 2 pieces ran 0.80x 8's.

So ``auto`` cuts up to `AUTO_PIECES_PER_SHARD` (8) pieces per shard, of about ``piece_link_s`` (4 ms)
on the probed link or more: ``rate_bps`` / 8 x ``piece_link_s`` bytes on the wire, rounded down to a power
of two between `PER_SHARD_FINEST_BYTES` (64 KiB) and `MAX_FINEST_WIRE_BYTES` (`auto_piece_rule`). A piece
pays a frame's CPU on every node it passes; what it buys, a shard answering one piece while the next is
still on its way, scales with its time on the link. On the 100 and 200 Mbit/s links that is 64 KiB (8
pieces, as `studies/ordered-tail/` and `studies/partitions-per-shard/` measured best); on the unshaped
bridge (6-14 Gbit/s probed) 2-4 MiB, one piece a shard for the digits model (its 0.2-0.4 MB ranges;
1.85x / 1.82x DDP against 1.61x / 1.39x with 2 pieces, `results/unshaped-pieces-20261125T092939Z`) and
one or two for the 26 MB model (1.41x / 1.35x with two against 1.46x / 1.30x with one).

Between the two, a piece's bytes grow with the rate rather than at one threshold.
`studies/auto-partitions/link-crossover.yaml` (commit 0796c20, `results/link-crossover-20261125T131011Z`;
docs/engines.md, "Pieces per shard") forced 8 pieces of 64 KiB and up (the slow rule) against 2 of 1 MiB
and up (the fast rule), 2 repeats each. The fast rule against the slow one, digits 4 / 8 workers, 26 MB
4 / 8 workers:

- 500 Mbit/s: ~0.99x / ~0.94x, 0.87x / 0.94x;
- 600 Mbit/s: 1.32x / ~0.98x, 0.88x / 0.95x;
- 800 Mbit/s: 1.25x / ~1.14x, 0.94x / ~1.04x;
- 1 Gbit/s: 1.54x / ~1.47x, 0.90x / ~1.08x;
- 2.5 Gbit/s: 2.27x / 1.29x, ~1.06x / 1.28x.

No one rate suits both models: the digits model's 0.1-0.25 MB ranges want one piece from 600 Mbit/s on,
while the 26 MB model's 2.9-5.2 MB ranges still want 8 pieces at 1 Gbit/s. Pieces of a fixed link time
give each what it measured best: 128 KiB at 500 Mbit/s, 256 KiB from 600 Mbit/s to 1 Gbit/s (one piece
of a digits range, 8 of a 26 MB one), 1 MiB at 2.5 Gbit/s (3-5 pieces of a 26 MB range). The rate steps
where the pieces double are 262 and 524 Mbit/s, 1.05, 2.1, 4.2 and 8.4 Gbit/s: the 100 and 200 Mbit/s
links keep the 64 KiB pieces measured there.

How the rate is measured. After every worker's ``ps_join`` and before the plan, the coordinator
probes each worker in turn (`probe_link`), `PROBE_ROUNDS` rounds of three ``ps_probe`` messages, each
answered with ``ps_probe_ack`` as soon as the worker holds it whole (`receive_answering_probes`): an
empty one (the round trip), one carrying `PROBE_BYTES` (the coordinator's egress to the worker), and
an empty one asking for `PROBE_BYTES` back (the worker's egress). A direction's transfer time is its
best round trip less the best empty one, its rate 8 x `PROBE_BYTES` over that; a worker's link is the
slower direction, and the run's rate the slowest worker's (`link_rate_bps`): a synchronous round goes
at its slowest link. The rates include the receive path's CPU, so a loaded machine can make a link
look slower (more pieces).

A shaper's burst would make it look faster. tc's token buckets let their burst through at the wire's
speed (the harness sets one timer tick of the rate, `harness.links.tc.burst_bytes`: 500 kB at 1 Gbit/s,
1.25 MB at 2.5 Gbit/s): 1 MiB, 8.4 ms at 1 Gbit/s, crosses in about 4.5 ms, and a probe of one size
(before 2026-11-25) read htb links 1.7-1.8x high at 1 Gbit/s, 1.5-2.3x at 2.5 Gbit/s and 1.2x at 500
Mbit/s (0.98-1.08x at 100 and 200 Mbit/s, where the burst is 50-100 kB). So a direction whose
`PROBE_BYTES` crossed in less than `SLOPE_BELOW_S` is probed again, as many rounds, with `PROBE_GROWTH`
times the bytes (at most `MAX_REPLY_BYTES`), and its rate is the extra bytes over the extra time between
the two best round trips: a burst (and the round trip) is in both and cancels out. Links slower than
about 400 Mbit/s cost no second probe.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from wiiide.errors import ProtocolError
from wiiide.wire.node import Connection
from wiiide.server.ps.partition import PER_SHARD_FINEST_BYTES
from wiiide.wire.encode import encode_message
from wiiide.wire.messages import Message, WireTensor

PROBE = "ps_probe"  # coordinator -> worker, before the plan: {"round", "reply_bytes"}, an optional uint8 fill
PROBE_ACK = "ps_probe_ack"  # worker -> coordinator: {"bytes": the fill's length}, a fill of reply_bytes
PROBE_BYTES = 1 << 20  # 1 MiB: 84 ms at 100 Mbit/s, 8.4 ms at 1 Gbit/s
MAX_REPLY_BYTES = 16 << 20  # the most a worker sends back for one probe
PROBE_ROUNDS = 2  # rounds per worker; the best of them counts
MAX_PROBES = 64  # probes a worker answers before its plan; more is a protocol error
MIN_TRANSFER_S = 1e-6  # a transfer measured shorter (or below zero: the empty round trip's noise) counts as this
SLOPE_BELOW_S = 0.02  # a direction whose probe crossed faster is measured again with more bytes (module docstring)
PROBE_GROWTH = 4  # the second probe of such a direction carries this many times the bytes
AUTO_PIECES_PER_SHARD = 8  # auto cuts a shard's range into at most this many pieces
MAX_FINEST_WIRE_BYTES = 16 << 20  # auto's pieces need not be larger than this on the wire


class PieceRule(NamedTuple):
    """How a run cuts each shard's range: at least `per_shard` pieces while they stay about
    `finest_wire_bytes` or more on the wire (`wiiide.server.ps.partition.range_partition_count`)."""

    per_shard: int
    finest_wire_bytes: int


# Every rule `auto_piece_rule` can give, finest first: a restarted run looks for its checkpoints in each.
AUTO_RULES = tuple(PieceRule(AUTO_PIECES_PER_SHARD, PER_SHARD_FINEST_BYTES << i)
                   for i in range((MAX_FINEST_WIRE_BYTES // PER_SHARD_FINEST_BYTES).bit_length()))


@dataclass(frozen=True)
class LinkProbe:
    """One worker's probe: the best empty round trip (`rtt_s`), and the seconds `down_bytes` took to
    the worker (`down_s`) and `up_bytes` back from it (`up_s`), each at least `MIN_TRANSFER_S`.

    A direction measured with one size: its bytes are `probe_bytes` (0 stands for it) and its seconds
    the best round trip that carried them less `rtt_s`. One measured again with a larger size (module
    docstring): its bytes are the difference of the two sizes and its seconds the difference of their
    best round trips."""

    rtt_s: float
    down_s: float
    up_s: float
    probe_bytes: int
    down_bytes: int = 0
    up_bytes: int = 0

    @property
    def down_bps(self) -> float:
        """The coordinator's egress to the worker, bit/s."""
        return 8 * (self.down_bytes or self.probe_bytes) / self.down_s

    @property
    def up_bps(self) -> float:
        """The worker's egress to the coordinator, bit/s."""
        return 8 * (self.up_bytes or self.probe_bytes) / self.up_s

    @property
    def rate_bps(self) -> float:
        """The slower direction, bit/s."""
        return min(self.down_bps, self.up_bps)

    def record(self) -> dict:
        """The report's record: ``rtt_s``, ``down_bps``, ``up_bps``, ``rate_bps``, and ``down_bytes`` /
        ``up_bytes`` for a direction measured from the difference of two sizes."""
        out = {"rtt_s": round(self.rtt_s, 6), "down_bps": round(self.down_bps), "up_bps": round(self.up_bps),
               "rate_bps": round(self.rate_bps)}
        out.update({f"{way}_bytes": n for way, n in (("down", self.down_bytes), ("up", self.up_bytes)) if n})
        return out


def probe_link(conn: Connection, rounds: int = PROBE_ROUNDS, probe_bytes: int = PROBE_BYTES) -> LinkProbe:
    """Probe the link to the worker behind `conn` both ways (module docstring); the worker answers with
    `receive_answering_probes`. `probe_bytes`: 1..`MAX_REPLY_BYTES`.

    Raises:
        OSError / WiiideError: from the connection (a lost or misbehaving worker); ProtocolError: an
        acknowledgement of another size than the probe's, or a reply of another size than asked for.
    """
    best = _best_round_trips(conn, ("empty", "down", "up"), rounds, probe_bytes)
    rtt_s = best["empty"]
    measured = {way: (0, max(MIN_TRANSFER_S, best[way] - rtt_s)) for way in ("down", "up")}
    big_bytes = min(PROBE_GROWTH * probe_bytes, MAX_REPLY_BYTES)
    again = [way for way in ("down", "up") if measured[way][1] < SLOPE_BELOW_S and big_bytes > probe_bytes]
    if again:
        big = _best_round_trips(conn, again, rounds, big_bytes)
        for way in again:
            measured[way] = (big_bytes - probe_bytes, max(MIN_TRANSFER_S, big[way] - best[way]))
    return LinkProbe(rtt_s, measured["down"][1], measured["up"][1], probe_bytes, measured["down"][0],
                     measured["up"][0])


def _best_round_trips(conn: Connection, ways: tuple[str, ...] | list[str], rounds: int,
                      probe_bytes: int) -> dict[str, float]:
    """The best of `rounds` round trips (s) of each of `ways`: ``empty``, ``down`` (`probe_bytes` to the
    worker) and ``up`` (`probe_bytes` asked back). Raises as `probe_link`."""
    fill = WireTensor("fill", np.zeros(probe_bytes, dtype=np.uint8))
    shapes = {"empty": ((), 0), "down": ((fill,), 0), "up": ((), probe_bytes)}
    best = {way: float("inf") for way in ways}
    for r in range(rounds):
        for way in ways:
            tensors, reply = shapes[way]
            frame = encode_message(PROBE, {"round": r, "reply_bytes": reply}, tensors)  # before the clock starts
            t0 = time.perf_counter()
            conn.send([frame])
            ack = conn.receive([PROBE_ACK])
            took_s = time.perf_counter() - t0
            sent = probe_bytes if tensors else 0
            if ack.meta.get("bytes") != sent:
                raise ProtocolError(f"{PROBE_ACK}: {ack.meta.get('bytes')!r:.40} bytes acknowledged, {sent} sent")
            got = _fill_bytes(ack)
            if got != reply:
                raise ProtocolError(f"{PROBE_ACK}: a reply of {got} bytes, {reply} asked for")
            best[way] = min(best[way], took_s)
    return best


def _fill_bytes(msg: Message) -> int:
    """The length of `msg`'s fill (0 without one). Raises ProtocolError: more than one tensor, or a fill
    that is not one uint8 vector."""
    if len(msg.tensors) > 1:
        raise ProtocolError(f"{msg.kind}: {len(msg.tensors)} tensors, expected at most one fill")
    if not msg.tensors:
        return 0
    fill = msg.tensor("fill")
    if fill.dtype != np.uint8 or fill.ndim != 1:
        raise ProtocolError(f"{msg.kind}: a fill of {fill.dtype} {fill.shape}, expected a uint8 vector")
    return int(fill.size)


def receive_answering_probes(conn: Connection, kind: str) -> Message:
    """A worker's receive of the next `kind` message, answering each ``ps_probe`` before it (with a
    fill of the ``reply_bytes`` it asks for).

    Raises:
        ProtocolError: more than `MAX_PROBES` probes, a probe whose fill is not one uint8 vector, or one
        asking for more than `MAX_REPLY_BYTES` back; and whatever `Connection.receive` raises.
    """
    for _ in range(MAX_PROBES + 1):
        msg = conn.receive([PROBE, kind])
        if msg.kind == kind:
            return msg
        size = _fill_bytes(msg)
        reply = msg.meta.get("reply_bytes", 0)
        if type(reply) is not int or not 0 <= reply <= MAX_REPLY_BYTES:  # noqa: E721
            raise ProtocolError(f"{PROBE}: reply_bytes must be an integer 0..{MAX_REPLY_BYTES}, got {reply!r:.40}")
        fill = [WireTensor("fill", np.zeros(reply, dtype=np.uint8))] if reply else []
        conn.send([encode_message(PROBE_ACK, {"bytes": size}, fill)])
    raise ProtocolError(f"more than {MAX_PROBES} {PROBE} messages before {kind}")


def link_rate_bps(probes: list[LinkProbe]) -> float:
    """The run's link rate (bit/s): the slowest worker's (`LinkProbe.rate_bps`). Raises ValueError on none."""
    if not probes:
        raise ValueError("no link probes")
    return min(p.rate_bps for p in probes)


def auto_piece_rule(rate_bps: float, piece_link_s: float) -> PieceRule:
    """``partitions_per_shard: auto`` on a link of `rate_bps` (bit/s, > 0): up to `AUTO_PIECES_PER_SHARD`
    pieces per shard of about `piece_link_s` seconds (>= 0) on that link or more: `rate_bps` / 8 x
    `piece_link_s` bytes on the wire, rounded down to a power of two (a probe's noise changes the plan
    only near the steps) and held within `PER_SHARD_FINEST_BYTES`..`MAX_FINEST_WIRE_BYTES`: one of
    `AUTO_RULES`. Module docstring for the measurements behind it.

    Raises:
        ValueError: a rate <= 0 or a negative `piece_link_s`.
    """
    if not rate_bps > 0 or not piece_link_s >= 0:
        raise ValueError(f"auto pieces need a rate > 0 and piece_link_s >= 0, got {rate_bps!r} and {piece_link_s!r}")
    wire_bytes = rate_bps / 8.0 * piece_link_s
    if wire_bytes <= PER_SHARD_FINEST_BYTES:
        return AUTO_RULES[0]
    doublings = math.floor(math.log2(wire_bytes / PER_SHARD_FINEST_BYTES))
    return AUTO_RULES[min(doublings, len(AUTO_RULES) - 1)]


def piece_rule(setting: int | str, rate_bps: float | None, piece_link_s: float) -> PieceRule:
    """How a run cuts its shards' ranges: `setting` pieces of 64 KiB and up when it is an integer, else
    (``auto``) `auto_piece_rule` of the probed `rate_bps` and `piece_link_s`.

    Raises:
        ValueError: ``auto`` without a rate, or a setting that is neither ``auto`` nor an integer >= 1.
    """
    if setting == "auto":
        if rate_bps is None:
            raise ValueError("partitions_per_shard auto needs the probed link rate")
        return auto_piece_rule(rate_bps, piece_link_s)
    if type(setting) is not int or setting < 1:  # noqa: E721
        raise ValueError(f"partitions_per_shard must be auto or an integer >= 1, got {setting!r:.40}")
    return PieceRule(setting, PER_SHARD_FINEST_BYTES)
