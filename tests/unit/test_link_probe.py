"""The link probe of ``partitions_per_shard: auto`` (`wiiide.server.ps.link_probe`) over a loopback TCP connection."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from wiiide.config import RunConfig
from wiiide.errors import ProtocolError
from wiiide.log import TieredLog
from wiiide.wire.node import EXIT_PEER_LOST, Connection, NodeFailure
from wiiide.server.ps.link_probe import (
    AUTO_RULES,
    MAX_FINEST_WIRE_BYTES,
    MAX_PROBES,
    MAX_REPLY_BYTES,
    PROBE,
    PROBE_ACK,
    LinkProbe,
    PieceRule,
    auto_piece_rule,
    link_rate_bps,
    piece_rule,
    probe_link,
    receive_answering_probes,
)
from wiiide.server.ps.session import _piece_rule
from wiiide.wire.encode import encode_message
from wiiide.wire.messages import WireTensor

CFG = RunConfig(log_tier="silent")


def _in_thread(fn, *args) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def run() -> None:
        try:
            out["value"] = fn(*args)
        except Exception as exc:  # handed to the test's thread
            out["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def test_a_worker_answers_every_probe_and_returns_the_plan_after_them(conn_pair):
    coord, worker = conn_pair
    thread, out = _in_thread(receive_answering_probes, worker, "ps_plan")
    probe = probe_link(coord, rounds=3, probe_bytes=200_000)
    coord.send([encode_message("ps_plan", {"partitions": [[0, 5, 0]]})])
    thread.join(10)
    assert out["value"].kind == "ps_plan" and out["value"].meta == {"partitions": [[0, 5, 0]]}
    assert probe.probe_bytes == 200_000 and probe.rtt_s > 0 and probe.down_s > 0 and probe.up_s > 0
    assert probe.rate_bps == min(probe.down_bps, probe.up_bps)
    # 200 kB crosses loopback far faster than SLOPE_BELOW_S: both ways were probed again with 4x the bytes
    assert probe.down_bytes == probe.up_bytes == 600_000
    assert set(probe.record()) == {"rtt_s", "down_bps", "up_bps", "rate_bps", "down_bytes", "up_bytes"}


def _slow_worker(worker: Connection, hold_s: float, hold_up: bool) -> None:
    """A worker that holds each full probe of one direction `hold_s` before its ack."""
    while True:
        msg = worker.receive([PROBE, "ps_plan"])
        if msg.kind == "ps_plan":
            return
        reply = msg.meta["reply_bytes"]
        if (reply if hold_up else msg.tensors):
            time.sleep(hold_s)
        fill = [WireTensor("fill", np.zeros(reply, np.uint8))] if reply else []
        worker.send([encode_message(PROBE_ACK, {"bytes": msg.tensor("fill").size if msg.tensors else 0}, fill)])


@pytest.mark.parametrize("hold_up", [False, True])
def test_a_link_slow_one_way_makes_the_link_slow(conn_pair, hold_up):
    """A worker that holds each full probe of one direction 0.3 s: that direction's transfer takes at
    least 0.3 s less the empty round trip, its rate is at most 1 MiB / 0.3 s (28 Mbit/s and the
    round trip's noise), and the link is that slow direction: auto cuts pieces of 64 KiB."""
    coord, worker = conn_pair
    thread, _ = _in_thread(_slow_worker, worker, 0.3, hold_up)
    probe = probe_link(coord, rounds=2)
    coord.send([encode_message("ps_plan")])
    thread.join(10)
    slow_s, fast_s = (probe.up_s, probe.down_s) if hold_up else (probe.down_s, probe.up_s)
    assert slow_s >= 0.3 - probe.rtt_s and fast_s < slow_s
    assert probe.rate_bps == (probe.up_bps if hold_up else probe.down_bps)
    assert piece_rule("auto", link_rate_bps([probe]), CFG.piece_link_s) == PieceRule(8, 64 * 1024)


def _bursty_worker(worker: Connection, burst_bytes: int, rate_bytes_per_s: float) -> None:
    """A worker behind a token bucket: the first `burst_bytes` of each probe come at once, the rest at
    `rate_bytes_per_s` (the probe held for what is past the burst), as tc's htb lets its burst through."""
    while True:
        msg = worker.receive([PROBE, "ps_plan"])
        if msg.kind == "ps_plan":
            return
        reply = msg.meta["reply_bytes"]
        size = msg.tensor("fill").size if msg.tensors else reply
        time.sleep(max(0, size - burst_bytes) / rate_bytes_per_s)
        fill = [WireTensor("fill", np.zeros(reply, np.uint8))] if reply else []
        worker.send([encode_message(PROBE_ACK, {"bytes": msg.tensor("fill").size if msg.tensors else 0}, fill)])


def test_a_shapers_burst_cancels_out_of_the_rate(conn_pair):
    """A 200 kB probe behind a 150 kB burst at 6.5 MB/s is held 7.7 ms (under SLOPE_BELOW_S): by its size
    alone the link would read 26 MB/s, 4x its rate. The second probe of 800 kB is held 100 ms, and the
    600 kB between the two sizes over the 92 ms between them give the rate. Sleeps only run long (more
    so on a loaded machine), which makes the rate read low, never high: the check is that the burst does
    not inflate it, i.e. it reads well below the 26 MB/s of the small probe's size alone."""
    coord, worker = conn_pair
    rate_bytes_per_s = 6.5e6
    thread, _ = _in_thread(_bursty_worker, worker, 150_000, rate_bytes_per_s)
    probe = probe_link(coord, rounds=2, probe_bytes=200_000)
    coord.send([encode_message("ps_plan")])
    thread.join(10)
    assert probe.down_bytes == probe.up_bytes == 600_000
    for rate_bps in (probe.down_bps, probe.up_bps):
        assert 0 < rate_bps < 1.5 * 8 * rate_bytes_per_s


def test_an_acknowledgement_or_a_reply_of_another_size_is_refused(conn_pair):
    coord, worker = conn_pair

    def lying_worker(ack_bytes: int, reply_bytes: int) -> None:
        worker.receive([PROBE])
        fill = [WireTensor("fill", np.zeros(reply_bytes, np.uint8))] if reply_bytes else []
        worker.send([encode_message(PROBE_ACK, {"bytes": ack_bytes}, fill)])

    _in_thread(lying_worker, 7, 0)
    with pytest.raises(ProtocolError, match="ps_probe_ack: 7 bytes acknowledged, 0 sent"):
        probe_link(coord, rounds=1, probe_bytes=1000)
    _in_thread(lying_worker, 0, 10)
    with pytest.raises(ProtocolError, match="ps_probe_ack: a reply of 10 bytes, 0 asked for"):
        probe_link(coord, rounds=1, probe_bytes=1000)


def test_a_worker_refuses_endless_probes_and_odd_fills(conn_pair):
    coord, worker = conn_pair
    thread, out = _in_thread(receive_answering_probes, worker, "ps_plan")
    for r in range(MAX_PROBES + 1):
        coord.send([encode_message(PROBE, {"round": r})])
    thread.join(10)
    assert isinstance(out["error"], ProtocolError) and f"more than {MAX_PROBES} ps_probe" in str(out["error"])

    thread, out = _in_thread(receive_answering_probes, worker, "ps_plan")
    coord.send([encode_message(PROBE, {"round": 0}, [WireTensor("fill", np.zeros(4, np.float32))])])
    thread.join(10)
    assert isinstance(out["error"], ProtocolError) and "a uint8 vector" in str(out["error"])

    thread, out = _in_thread(receive_answering_probes, worker, "ps_plan")
    coord.send([encode_message(PROBE, {"round": 0, "reply_bytes": MAX_REPLY_BYTES + 1})])
    thread.join(10)
    assert isinstance(out["error"], ProtocolError) and "reply_bytes must be an integer" in str(out["error"])


def test_auto_cuts_pieces_of_about_a_fixed_time_on_the_link():
    """Up to 8 pieces per shard, each rate / 8 x piece_link_s on the wire rounded down to a power of two:
    with the default 4 ms, 64 KiB on the 100 and 200 Mbit/s links (the pieces measured best there),
    128 KiB at 500 Mbit/s, 256 KiB at 1 Gbit/s, 1 MiB at 2.5 Gbit/s, 16 MiB at most."""
    t = CFG.piece_link_s
    assert t == 0.004
    kib = 1024
    expected = {100e6: 64 * kib, 200e6: 64 * kib, 500e6: 128 * kib, 600e6: 256 * kib, 1e9: 256 * kib,
                1.1e9: 512 * kib, 2.5e9: 1024 * kib, 10e9: 4096 * kib, 1e12: 16384 * kib}
    for rate_bps, finest in expected.items():
        assert piece_rule("auto", rate_bps, t) == auto_piece_rule(rate_bps, t) == PieceRule(8, finest), rate_bps
    rates = np.geomspace(300e6, 40e9, 200)  # between the floor and the cap: a piece spends t/2..t on the link
    for rate_bps in rates:
        rule = auto_piece_rule(rate_bps, t)
        assert rule in AUTO_RULES and t / 2 < rule.finest_wire_bytes * 8 / rate_bps <= t
    finest = [auto_piece_rule(r, t).finest_wire_bytes for r in np.geomspace(1e6, 1e12, 200)]
    assert finest == sorted(finest) and finest[0] == 64 * kib and finest[-1] == MAX_FINEST_WIRE_BYTES
    assert auto_piece_rule(1e12, 0.0) == AUTO_RULES[0] == PieceRule(8, 64 * kib)  # 0: the finest pieces
    assert len(set(AUTO_RULES)) == len(AUTO_RULES) == 9


def test_piece_rule_keeps_an_integer_setting_and_refuses_bad_ones():
    assert piece_rule(3, None, 0.004) == PieceRule(3, 64 * 1024)  # an integer setting is kept, probe or not
    with pytest.raises(ValueError, match="needs the probed link rate"):
        piece_rule("auto", None, 0.004)
    with pytest.raises(ValueError, match="auto or an integer"):
        piece_rule(0, None, 0.004)
    with pytest.raises(ValueError, match="rate > 0"):
        auto_piece_rule(0.0, 0.004)
    with pytest.raises(ValueError, match="piece_link_s >= 0"):
        auto_piece_rule(1e9, -0.001)


def test_the_runs_rate_is_the_slowest_workers_slower_direction():
    probes = [LinkProbe(1e-4, 0.005, 0.004, 1_000_000), LinkProbe(1e-4, 0.002, 0.08, 1_000_000),
              LinkProbe(1e-4, 0.003, 0.003, 1_000_000)]  # worker 2's own uplink is slow
    assert link_rate_bps(probes) == probes[1].up_bps < probes[0].down_bps < probes[2].rate_bps
    with pytest.raises(ValueError):
        link_rate_bps([])


def test_a_worker_lost_during_the_probe_fails_the_run_naming_it(conn_pair):
    """The coordinator's side (`wiiide.server.ps.session._pieces_per_shard`): a worker that closes its
    connection instead of answering is dropped, and the run fails with exit 4 and the worker named."""
    coord_conn, worker = conn_pair
    dropped = []
    slot = SimpleNamespace(rank=2, node_id="w2", conn=coord_conn, alive=True)
    coord = SimpleNamespace(cfg=RunConfig(log_tier="silent", num_workers=1), log=TieredLog(CFG, "coordinator"),
                            drop=lambda w, exc: dropped.append((w.rank, type(exc).__name__)))
    worker.sock.close()
    with pytest.raises(NodeFailure, match="lost worker 2 \\(w2\\) during the link probe") as info:
        _piece_rule(coord, [slot])
    assert info.value.exit_code == EXIT_PEER_LOST and dropped and dropped[0][0] == 2
    fixed = SimpleNamespace(cfg=RunConfig(log_tier="silent", partitions_per_shard=4), log=coord.log)
    assert _piece_rule(fixed, [slot]) == (PieceRule(4, 64 * 1024), None)  # an integer setting probes nothing
