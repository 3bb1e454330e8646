"""Compression policies: names, the seed rule, fixed lossy codecs after warm-up, and network-aware
choices on synthetic speed/ratio estimates (deterministic: no timing of real codecs is asserted)."""

from __future__ import annotations

import numpy as np
import pytest

from wiiide.codecs.link_estimate import LinkEstimate
from wiiide.codecs.policy import (
    FEEDBACK_META_KEY,
    CompressionPolicy,
    check_policy_name,
    parse_policy_name,
)
from wiiide.config import RunConfig
from wiiide.wire.messages import WireTensor

MB = 1_000_000
GRAD = 1_204_264  # the digits MLP 64-512-512-10's gradient, bytes


@pytest.mark.parametrize("name, mode, codec", [
    ("none", "fixed", "none"), ("zlib-3", "fixed", "zlib-3"), ("fixed:zstd-1", "fixed", "zstd-1"),
    ("fixed:topk-0.01", "fixed", "topk-0.01"), ("fixed:shuffle-lz4", "fixed", "shuffle-lz4"),
    ("adaptive", "seed", None), ("seed", "seed", None), ("network-aware", "network-aware", None),
    ("network-aware+lossy", "network-aware", None)])
def test_policy_names(name, mode, codec):
    assert parse_policy_name(name) == (mode, codec)
    assert check_policy_name(name) is None
    assert RunConfig(compression=name).compression == name


@pytest.mark.parametrize("name", ["lz4", "zstd-1", "fixed:", "fixed:brotli", "fixed:zlib-0", "network", "Seed", ""])
def test_bad_policy_names(name):
    assert check_policy_name(name)
    with pytest.raises(ValueError):
        CompressionPolicy(name)


def test_seed_rule_is_the_old_adaptive():
    for name in ("seed", "adaptive"):
        p = CompressionPolicy(name, threshold_bytes=1024 * 1024)
        assert p.choose("gradients", 1024 * 1024 + 1).name == "zlib-1"
        assert p.choose("gradients", 1024 * 1024).name == "none"
        assert p.choose("params", 10).name == "zlib-9"
        assert p.choose("batch", 10 * MB).name == "zlib-9"


def test_fixed_lossy_codec_only_for_gradients_after_warmup():
    p = CompressionPolicy("fixed:fp16", lossy_warmup_steps=3)
    assert [p.choose("gradients", GRAD).name for _ in range(5)] == ["none", "none", "none", "fp16", "fp16"]
    assert p.choose("params", GRAD).name == "none"
    assert p.choose("batch", GRAD).name == "none"
    ints = [np.zeros(10, np.int64)]
    assert p.choose("gradients", 80, ints).name == "none"  # float32 only


def test_fixed_lossless_codec_for_every_message():
    p = CompressionPolicy("fixed:shuffle-zstd", lossy_warmup_steps=100)
    assert {p.choose(k, GRAD).name for k in ("gradients", "params", "batch")} == {"shuffle-zstd"}


def synthetic_policy(link_bps: float, probe_every: int = 1000, **kw) -> CompressionPolicy:
    """A network-aware policy whose estimates are injected: gradients of GRAD bytes, every codec measured.

    Speeds (bytes/s) and ratios are this machine's order of magnitude on a real gradient.
    """
    p = CompressionPolicy("network-aware", link_bandwidth_bps=link_bps, probe_every=probe_every, **kw)
    table = {"none": (1.0, 0, 0), "lz4": (1.01, 1.5e9, 8e9), "zstd-1": (1.09, 500e6, 1e9),
             "shuffle-lz4": (1.05, 1.0e9, 5e9), "shuffle-zstd": (1.18, 400e6, 1.7e9),
             "fp16": (2.0, 1e9, 2e9), "bf16": (2.0, 800e6, 2e9), "int8": (3.9, 200e6, 1e9),
             "topk-0.01": (50.0, 20e6, 1e9)}
    for name, (ratio, enc, dec) in table.items():
        for _ in range(2):  # measured twice: the second sample replaces the first (cold start)
            p.observe("gradients", name, GRAD, int(GRAD / ratio), GRAD / enc if enc else 0.0, GRAD / dec if dec else None)
    return p


def test_a_cold_first_sample_does_not_decide():
    p = CompressionPolicy("network-aware", link_bandwidth_bps=100e6, probe_every=2)
    for _ in range(2):
        p.observe("gradients", "none", GRAD, GRAD, 0.0)
        for name in ("lz4", "zstd-1", "shuffle-lz4"):
            p.observe("gradients", name, GRAD, GRAD, 0.001, 0.001)
    p.observe("gradients", "shuffle-zstd", GRAD, int(GRAD / 1.18), 0.7, 0.001)  # first use under load: 0.7 s
    assert p.estimate_s("gradients", "shuffle-zstd", GRAD) > 0.7
    assert p.choose("gradients", GRAD).name == "shuffle-zstd"  # measured once only: tried again first
    p.observe("gradients", "shuffle-zstd", GRAD, int(GRAD / 1.18), 0.003, 0.001)
    assert p.estimate_s("gradients", "shuffle-zstd", GRAD) == pytest.approx(0.003 + 8 * GRAD / 1.18 / 100e6 + 0.001,
                                                                           rel=1e-3)
    assert p.choose("gradients", GRAD).name == "shuffle-zstd"


@pytest.mark.parametrize("link_bps, expected", [
    (10e9, "none"),            # the CPU is the bottleneck: send as is
    (1e9, "none"),             # 9.6 ms raw vs 8.8 + 2.4 + 0.7 ms with shuffle-zstd
    (100e6, "shuffle-zstd"),   # the link is: the best ratio that pays for itself
    (20e6, "shuffle-zstd"),
])
def test_network_aware_lossless_choice_follows_the_link(link_bps, expected):
    p = synthetic_policy(link_bps)
    assert p.choose("gradients", GRAD).name == expected
    est = {c: p.estimate_s("gradients", c, GRAD) for c in p.candidates("gradients")}
    assert min(est, key=est.get) == expected


def test_network_aware_estimate_formula():
    p = synthetic_policy(100e6)
    expected = GRAD / 400e6 + 8 * GRAD / 1.18 / 100e6 + GRAD / 1.7e9
    assert p.estimate_s("gradients", "shuffle-zstd", GRAD) == pytest.approx(expected)
    assert p.estimate_s("gradients", "none", GRAD) == pytest.approx(8 * GRAD / 100e6)
    assert p.estimate_s("params", "none", GRAD) is None  # estimates are per message kind


def test_network_aware_lossy_only_when_allowed_and_after_warmup():
    p = synthetic_policy(100e6, allow_lossy=True, lossy_warmup_steps=2)
    # the injected samples did not count as gradient messages; the first two are warm-up
    assert [p.choose("gradients", GRAD).name for _ in range(2)] == ["shuffle-zstd", "shuffle-zstd"]
    # 100 Mbit/s: int8 (6 + 25 + 1 ms) beats top-k (60 ms to select) and shuffle-zstd (85 ms)
    assert p.choose("gradients", GRAD).name == "int8"
    assert p.candidates("params") == p.candidates("gradients", [np.zeros(3, np.int32)])  # never lossy there
    assert not {"fp16", "bf16", "int8", "topk-0.01"} & set(p.candidates("params"))
    q = synthetic_policy(100e6, allow_lossy=False, lossy_warmup_steps=0)
    assert all(q.choose("gradients", GRAD).name == "shuffle-zstd" for _ in range(5))
    assert CompressionPolicy("network-aware+lossy").allow_lossy and not CompressionPolicy("network-aware").allow_lossy


def test_network_aware_tries_every_candidate_first_then_probes():
    p = CompressionPolicy("network-aware", link_bandwidth_bps=100e6, probe_every=4)
    first = []
    for _ in range(2 * len(p.candidates("gradients"))):  # each candidate twice
        codec = p.choose("gradients", GRAD)
        first.append(codec.name)
        ratio = {"shuffle-zstd": 1.18}.get(codec.name, 1.0)
        p.observe("gradients", codec.name, GRAD, int(GRAD / ratio), 0.001 if codec.name != "none" else 0.0, 0.001)
    assert sorted(first) == sorted(2 * p.candidates("gradients"))
    assert first[:5] == p.candidates("gradients")  # round robin
    picks = [p.choose("gradients", GRAD).name for _ in range(40)]  # messages 11..50
    probes = [i + 11 for i, c in enumerate(picks) if c != "shuffle-zstd"]
    # every 4th message at first, then 8, 16 (the best stays the same: the interval doubles)
    assert probes == [15, 23, 39]
    assert p.choose("gradients", 100).name == "none"  # tiny messages are never compressed


def test_network_aware_probes_only_codecs_near_the_best():
    p = synthetic_policy(10e9, probe_every=2)
    p.probe_every = 2
    picks = {p.choose("gradients", GRAD).name for _ in range(40)}
    # at 10 Gbit/s none takes 1 ms; zstd-1 (4 ms) and shuffle-zstd (4.7 ms) are never worth a probe
    assert "zstd-1" not in picks and "shuffle-zstd" not in picks and "none" in picks


def test_network_aware_records_choices_and_reasons():
    record: dict = {}
    p = CompressionPolicy("network-aware", link_bandwidth_bps=100e6, record=record)
    g = (np.random.default_rng(0).standard_normal(GRAD // 4) * 1e-3).astype(np.float32)
    for step in range(13):
        p.encode("gradients", {"step": step}, [WireTensor("grad", g)])
    rec = record["compression_policy"]
    assert rec["policy"] == "network-aware" and rec["link_bandwidth_bps_config"] == 100e6
    assert sum(rec["choices"]["gradients"].values()) == 13
    assert rec["reasons"]["first try"] == 10 and rec["reasons"]["lowest estimate"] == 3
    assert set(rec["estimates"]["gradients"]) == {"none", "lz4", "zstd-1", "shuffle-lz4", "shuffle-zstd"}
    assert rec["estimates"]["gradients"]["shuffle-zstd"]["ratio"] > 1.1
    assert rec["estimates"]["gradients"]["zstd-1"]["decode_bytes_per_s"] > 0  # measured by decoding its own output
    d = rec["decisions"][-1]
    assert set(d) >= {"message", "codec", "reason", "link_bps", "estimates_s"}


def test_link_estimate_is_a_low_quantile_of_large_frames():
    est = LinkEstimate(min_bytes=1000, window=8)
    assert est.bps is None
    est.observe(500, 1.0)  # too small to count
    assert est.bps is None
    for _ in range(6):
        est.observe(1_250_000, 0.1)  # 100 Mbit/s
    for _ in range(2):
        est.observe(1_250_000, 0.001)  # already buffered: 10 Gbit/s, not the link
    assert est.bps == pytest.approx(100e6)


def test_policy_without_configured_bandwidth_uses_the_measured_one():
    p = synthetic_policy(0)
    assert p.link_bps() == (1e9, "assumed")

    class Msg:
        payload_nbytes, payload_recv_s = GRAD, 8 * GRAD / 50e6  # 50 Mbit/s
    for _ in range(4):
        p.observe_received(Msg())
    assert p.link_bps()[1] == "measured" and p.link_bps()[0] == pytest.approx(50e6)
    assert p.choose("gradients", GRAD).name == "shuffle-zstd"


def test_from_config_reads_every_codec_knob():
    cfg = RunConfig(compression="network-aware", codec_threads=2, codec_chunk_bytes=128 * 1024,
                    link_bandwidth_bps=200_000_000, allow_lossy=True, lossy_warmup_steps=5, topk_fraction=0.05,
                    codec_probe_every=7)
    extra: dict = {}
    p = CompressionPolicy.from_config(cfg, extra)
    try:
        assert p.pool.threads == 2 and p.pool.chunk_bytes == 128 * 1024
        assert p.link_bps() == (200e6, "config") and p.probe_every == 7
        assert "topk-0.05" not in p.candidates("gradients")  # warm-up
        for _ in range(6):
            p.choose("gradients", GRAD)
        assert "topk-0.05" in p.candidates("gradients") and "int8" in p.candidates("gradients")
        assert extra["compression_policy"]["allow_lossy"] is True
    finally:
        p.close()


def test_one_slow_sample_does_not_change_a_codecs_speed():
    p = synthetic_policy(200e6)
    before = p.estimate_s("gradients", "shuffle-zstd", GRAD)
    p.observe("gradients", "shuffle-zstd", GRAD, int(GRAD / 1.18), 0.050, 0.001)  # a burst of other work
    assert p.estimate_s("gradients", "shuffle-zstd", GRAD) == pytest.approx(before)
    assert p.choose("gradients", GRAD).name == "shuffle-zstd"
    for _ in range(5):  # but a codec that really got slower is seen as slower once its fast samples age out
        p.observe("gradients", "shuffle-zstd", GRAD, int(GRAD / 1.18), 0.050, 0.001)
    assert p.estimate_s("gradients", "shuffle-zstd", GRAD) > before + 0.04


class _Received:
    """What `CompressionPolicy.observe_received` reads of a `wiiide.wire.messages.Message`."""

    def __init__(self, payload_nbytes: int, rate_bps: float, meta: dict | None = None) -> None:
        self.payload_nbytes, self.payload_recv_s = payload_nbytes, 8 * payload_nbytes / rate_bps
        self.meta = meta or {}


def test_the_uplink_a_receiver_reports_beats_the_symmetric_assumption():
    """A parameter server reads gradients at 10 Gbit/s (buffered, or a fast downlink) but its own
    messages reach the worker at 50 Mbit/s: the worker's report decides, not the symmetric guess."""
    server, worker = synthetic_policy(0), CompressionPolicy("network-aware")
    try:
        assert worker.feedback_meta() == {}  # nothing received yet: nothing to report
        for _ in range(4):
            worker.observe_received(_Received(GRAD, 50e6))  # the server's params, as they arrived
        report = worker.feedback_meta()
        assert report == {FEEDBACK_META_KEY: pytest.approx(50e6, rel=1e-6)}
        server.observe_received(_Received(GRAD, 10e9))
        assert server.link_bps() == (pytest.approx(10e9), "measured")
        assert server.choose("gradients", GRAD).name == "none"  # the symmetric guess: a fast link
        for _ in range(3):
            server.observe_received(_Received(GRAD, 10e9, meta={"step": 1, **report}), peer="w1")
        assert server.link_bps() == (pytest.approx(50e6), "reported")
        assert server.record["uplink_bps_reported"] == pytest.approx(50e6)
        assert server.choose("gradients", GRAD).name == "shuffle-zstd"  # the real uplink is slow
    finally:
        server.close()
        worker.close()


def test_feedback_is_per_peer_and_bad_reports_are_ignored():
    server = CompressionPolicy("network-aware")
    try:
        server.observe_received(_Received(GRAD, 100e6), peer="w1")
        server.observe_received(_Received(GRAD, 400e6), peer="w2")
        server.observe_received(_Received(1000, 1e6), peer="w3")  # too small to measure a rate
        assert server.feedback_meta("w1") == {FEEDBACK_META_KEY: pytest.approx(100e6, rel=1e-6)}
        assert server.feedback_meta("w2") == {FEEDBACK_META_KEY: pytest.approx(400e6, rel=1e-6)}
        assert server.feedback_meta("w3") == server.feedback_meta("nobody") == {}
        for bad in ("fast", -5, 0, True, float("inf"), float("nan"), [1e6], None):
            server.observe_received(_Received(GRAD, 200e6, meta={FEEDBACK_META_KEY: bad}), peer="w1")
        assert server.uplink.bps is None and server.link_bps()[1] == "measured"
    finally:
        server.close()


def test_payload_bytes_already_queued_do_not_count_for_the_report():
    """The parameter server reads its 4th worker's gradient after the other three: most of it waited in
    the socket's queue. Only what arrived during the read measures that worker's uplink."""
    server = CompressionPolicy("network-aware")
    try:
        buffered = _Received(GRAD, 10e9)
        buffered.payload_queued_nbytes = GRAD - 1000  # all but 1000 bytes were there: too few to measure
        server.observe_received(buffered, peer="w4")
        assert server.feedback_meta("w4") == {}
        half = _Received(GRAD, 400e6)  # half of it queued: the other half came in the measured time
        half.payload_queued_nbytes = GRAD // 2
        server.observe_received(half, peer="w4")
        assert server.feedback_meta("w4") == {FEEDBACK_META_KEY: pytest.approx(200e6, rel=1e-3)}
    finally:
        server.close()


def test_link_estimate_quantile_matches_numpy_on_any_window():
    rng = np.random.default_rng(7)
    for n in (1, 2, 3, 8, 32):
        est = LinkEstimate(min_bytes=1, window=32, quantile=0.25)
        rates = rng.uniform(1e6, 1e10, size=n)
        for bps in rates:
            est.observe_rate(float(bps))
        assert est.bps == pytest.approx(float(np.quantile(rates, 0.25)), rel=1e-12)


def test_a_sharded_runs_partitions_feed_the_link_estimate():
    """Sharded servers move partitions (64 KiB here), below the default smallest payload the link
    estimate counts (256 KiB): from a config the policy counts payloads of half a partition and up, so
    network-aware learns the link from pulls and pushes; the central server's default is unchanged."""
    sharded = CompressionPolicy.from_config(RunConfig(compression="network-aware", ps_shards="all",
                                                      partition_bytes=64 * 1024))
    central = CompressionPolicy.from_config(RunConfig(compression="network-aware"))
    try:
        for policy in (sharded, central):
            for _ in range(3):
                policy.observe_received(_Received(64 * 1024, 100e6))
        assert sharded.link_bps() == (pytest.approx(100e6), "measured")
        assert central.link_bps()[1] == "assumed"  # 64 KiB payloads do not count at the default
    finally:
        sharded.close()
        central.close()
