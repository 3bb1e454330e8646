"""The link probe behind ``partitions_per_shard: auto``: how fast the coordinator's link is, before the plan.

Why pieces follow the link. A shard cuts its range into pieces so that it can answer one while the
next is still arriving (pipelining over the link); every piece costs each node a frame's CPU (encode,
send and receive calls, a decode). Measured with sharded fp32 against DDP fp32 (README, "Sharded
parameter servers", session 16; digits 4 / 8 workers, 26 MB 4 / 8 workers):

- unshaped Docker bridge (`results/unshaped-pieces-20261125T080607Z`): 8 pieces per shard 1.19 / 1.49 /
  1.35 / ~0.90x, 2 pieces 1.58 / 1.44 / 1.43 / 1.20x: where a piece crosses the link in less time than
  its frame costs, the pipelining gains less than the frames cost;
- 100 Mbit/s (`results/shaped-pieces-20261125T082614Z`): 8 pieces 1.22 / 1.17 / 1.25x, 2 pieces 1.20 /
  1.13 / ~1.02x, and at 26 MB / 8 workers 2 pieces ran 0.80x 8's.

So ``auto`` cuts `AUTO_PIECES_SLOW_LINK` (8) pieces per shard on a link slower than ``fast_link_bps``
(default 1 Gbit/s: 5x the fastest shaped link measured, 200 Mbit/s) and `AUTO_PIECES_FAST_LINK` (2)
on one at least that fast.

How the rate is measured. After every worker's ``ps_join`` and before the plan, the coordinator
probes each worker in turn (`probe_link`): `PROBE_ROUNDS` rounds of an empty ``ps_probe`` and one
carrying `PROBE_BYTES`, each answered with ``ps_probe_ack`` as soon as the worker holds it whole
(`receive_answering_probes`). The transfer time is the best full round trip less the best empty one;
the rate is 8 x `PROBE_BYTES` over it. The run's rate is the median over the workers (`link_rate_bps`).
The probe measures the coordinator's egress and the workers' receive path, CPU included: the harness
shapes every node's egress alike (`harness/links/tc.py`), and a loaded machine can only make a link
look slower (more pieces), never faster.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import numpy as np

from wiiide.errors import ProtocolError
from wiiide.node import Connection
from wiiide.protocol import Message, WireTensor, encode_message

PROBE = "ps_probe"  # coordinator -> worker, before the plan: {"round"}, an optional uint8 fill
PROBE_ACK = "ps_probe_ack"  # worker -> coordinator: {"bytes": the fill's length}
PROBE_BYTES = 1 << 20  # 1 MiB: 84 ms at 100 Mbit/s, 8.4 ms at the 1 Gbit/s default threshold
PROBE_ROUNDS = 2  # rounds per worker; the best of them counts
MAX_PROBES = 64  # probes a worker answers before its plan; more is a protocol error
MIN_TRANSFER_S = 1e-6  # a transfer measured shorter (or below zero: the empty round trip's noise) counts as this
AUTO_PIECES_SLOW_LINK = 8
AUTO_PIECES_FAST_LINK = 2


@dataclass(frozen=True)
class LinkProbe:
    """One worker's probe: the best empty round trip (`rtt_s`), the best round trip of `probe_bytes`
    less it (`transfer_s`, at least `MIN_TRANSFER_S`), and the rate that gives (bit/s)."""

    rtt_s: float
    transfer_s: float
    probe_bytes: int

    @property
    def rate_bps(self) -> float:
        return 8 * self.probe_bytes / self.transfer_s

    def record(self) -> dict:
        return {"rtt_s": round(self.rtt_s, 6), "transfer_s": round(self.transfer_s, 6),
                "rate_bps": round(self.rate_bps)}


def probe_link(conn: Connection, rounds: int = PROBE_ROUNDS, probe_bytes: int = PROBE_BYTES) -> LinkProbe:
    """Probe the link to the worker behind `conn` (module docstring); the worker answers with
    `receive_answering_probes`.

    Raises:
        OSError / WiiideError: from the connection (a lost or misbehaving worker); ProtocolError: an
        acknowledgement of another size than the probe's.
    """
    fill = WireTensor("fill", np.zeros(probe_bytes, dtype=np.uint8))
    empty_s, full_s = float("inf"), float("inf")
    for r in range(rounds):
        for tensors in ((), (fill,)):
            frame = encode_message(PROBE, {"round": r}, tensors)  # built before the clock starts
            t0 = time.perf_counter()
            conn.send([frame])
            ack = conn.receive([PROBE_ACK])
            took_s = time.perf_counter() - t0
            sent = probe_bytes if tensors else 0
            if ack.meta.get("bytes") != sent:
                raise ProtocolError(f"{PROBE_ACK}: {ack.meta.get('bytes')!r:.40} bytes acknowledged, {sent} sent")
            if tensors:
                full_s = min(full_s, took_s)
            else:
                empty_s = min(empty_s, took_s)
    return LinkProbe(empty_s, max(MIN_TRANSFER_S, full_s - empty_s), probe_bytes)


def receive_answering_probes(conn: Connection, kind: str) -> Message:
    """A worker's receive of the next `kind` message, answering each ``ps_probe`` before it.

    Raises:
        ProtocolError: more than `MAX_PROBES` probes, or a probe whose fill is not one uint8 vector;
        and whatever `Connection.receive` raises.
    """
    for _ in range(MAX_PROBES + 1):
        msg = conn.receive([PROBE, kind])
        if msg.kind == kind:
            return msg
        if len(msg.tensors) > 1:
            raise ProtocolError(f"{PROBE}: {len(msg.tensors)} tensors, expected at most one fill")
        size = 0
        if msg.tensors:
            fill = msg.tensor("fill")
            if fill.dtype != np.uint8 or fill.ndim != 1:
                raise ProtocolError(f"{PROBE}: a fill of {fill.dtype} {fill.shape}, expected a uint8 vector")
            size = int(fill.size)
        conn.send([encode_message(PROBE_ACK, {"bytes": size})])
    raise ProtocolError(f"more than {MAX_PROBES} {PROBE} messages before {kind}")


def link_rate_bps(probes: list[LinkProbe]) -> float:
    """The run's link rate (bit/s): the median of the workers' probes. Raises ValueError on none."""
    if not probes:
        raise ValueError("no link probes")
    return float(statistics.median(p.rate_bps for p in probes))


def pieces_per_shard(setting: int | str, rate_bps: float | None, fast_link_bps: float) -> int:
    """The pieces per shard a run cuts: `setting` itself when it is an integer, else (``auto``)
    `AUTO_PIECES_FAST_LINK` when `rate_bps` >= `fast_link_bps`, `AUTO_PIECES_SLOW_LINK` when it is
    lower (module docstring for the measurements behind both).

    Raises:
        ValueError: ``auto`` without a rate, or a setting that is neither ``auto`` nor an integer >= 1.
    """
    if setting == "auto":
        if rate_bps is None:
            raise ValueError("partitions_per_shard auto needs the probed link rate")
        return AUTO_PIECES_FAST_LINK if rate_bps >= fast_link_bps else AUTO_PIECES_SLOW_LINK
    if type(setting) is not int or setting < 1:  # noqa: E721
        raise ValueError(f"partitions_per_shard must be auto or an integer >= 1, got {setting!r:.40}")
    return setting
