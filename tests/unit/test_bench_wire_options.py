"""bench-wire's options, plan, payload slicing, pacing and summary: no socket to another process, no timing."""

from __future__ import annotations

import numpy as np
import pytest

from harness.bench.wire.cli import parse_link_rates, parse_sizes, plan_from_args
from harness.bench.wire.frames import trial_orders
from harness.bench.wire.paced import PacedSocket
from harness.bench.wire.payloads import payload_of
from harness.bench.wire.plan import PlanError, WirePlan
from harness.bench.wire.summary import summarize
from harness.cli import build_parser
from harness.errors import SpecError
from wiiide.units import UnitError


def _args(*argv: str):
    return build_parser().parse_args(["bench-wire", *argv])


@pytest.mark.parametrize("text, expected", [
    ("256k", [262_144]),  # IEC, as wiiide/config.py reads it (schema 1 read 256,000)
    ("1MiB", [1_048_576]),
    ("64KiB, 1MiB,", [65_536, 1_048_576]),
    ("4096,1.5k,8m", [4096, 1536, 8 * 1024 * 1024]),
])
def test_sizes_are_iec_bytes(text, expected):
    assert parse_sizes(text) == expected


@pytest.mark.parametrize("text, expected", [
    ("100mbit,1gbit", [100e6, 1e9]),
    ("100mbit,200mbit,500mbit,1gbit,2.5gbit,0", [1e8, 2e8, 5e8, 1e9, 2.5e9, 0.0]),  # the documented default
    ("500kbit, unpaced", [5e5, 0.0]),
])
def test_link_rates_are_si_bits_per_second(text, expected):
    assert parse_link_rates(text) == expected


@pytest.mark.parametrize("parser, option, text, says", [
    (parse_sizes, "--sizes", "64 furlongs", "is not a size"),
    (parse_sizes, "--sizes", " , ", "empty list"),
    (parse_sizes, "--sizes", "-4", "is not a size"),
    (parse_link_rates, "--link-rates", "100", "is not a rate"),
    (parse_link_rates, "--link-rates", "100mbps", "ambiguous"),
    (parse_link_rates, "--link-rates", "", "empty list"),
])
def test_bad_values_name_the_option(parser, option, text, says):
    with pytest.raises(UnitError) as info:
        parser(text)
    assert str(info.value).startswith(f"{option}:") and says in str(info.value)


def test_plan_from_the_command_line():
    plan = plan_from_args(_args("--sizes", "256k,1MiB", "--link-rates", "100mbit,0", "--recv-chunk-bytes", "4MiB",
                                "--repeats", "3", "--bytes-per-trial-mib", "2", "--small"))
    assert plan.sizes_bytes == (262_144, 1_048_576) and plan.link_rates_bps == (1e8, 0.0)
    assert plan.recv_chunk_bytes == 4 * 1024 * 1024 and plan.bytes_per_trial == 2 * 1024 * 1024
    assert plan.repeats == 3 and plan.small is True
    assert plan_from_args(_args("--frame-readers", "exact,whole")).frame_readers == ("exact", "whole")
    default = plan_from_args(_args())
    assert default.frame_readers == ("whole",)  # the nodes' reader
    assert default == WirePlan() and default.recv_chunk_bytes == 64 * 1024 * 1024  # the nodes' default


@pytest.mark.parametrize("argv, starts", [
    (("--sizes", "6"), "bench-wire: --sizes: [6] bytes"),
    (("--sizes", "64 furlongs"), "bench-wire: --sizes: '64 furlongs'"),
    (("--link-rates", "fast"), "bench-wire: --link-rates: 'fast'"),
    (("--repeats", "0"), "bench-wire: --repeats: 0 must be >= 1"),
    (("--link-messages", "0"), "bench-wire: --link-messages"),
    (("--codec-threads", "0"), "bench-wire: --codec-threads"),
    (("--recv-chunk-bytes", "512"), "bench-wire: --recv-chunk-bytes: 512 bytes: at least 1 KiB"),
    (("--recv-chunk-bytes", "lots"), "bench-wire: --recv-chunk-bytes: 'lots'"),
    (("--frame-readers", "whole,fast"), "bench-wire: --frame-readers: ['whole', 'fast']"),
    (("--frame-readers", "whole,whole"), "bench-wire: --frame-readers: ['whole', 'whole']"),
])
def test_bad_options_raise_spec_error_naming_the_option(argv, starts):
    with pytest.raises(SpecError) as info:
        plan_from_args(_args(*argv))
    assert str(info.value).startswith(starts)


def test_plan_round_trips_through_json_values_and_refuses_unknown_names():
    plan = WirePlan(sizes_bytes=(4096,), link_rates_bps=(1e8, 0), table_threads=(1,), small=True)
    assert WirePlan.from_dict(plan.as_dict()) == plan
    assert plan.as_dict()["sizes_bytes"] == [4096]
    with pytest.raises(PlanError, match=r"unknown keys \['sizes'\]"):
        WirePlan.from_dict({"sizes": [4096]})  # schema 1's name
    with pytest.raises(PlanError, match="frame_codecs"):
        WirePlan(frame_codecs=("zstd-99",))
    with pytest.raises(PlanError, match="link_policies"):
        WirePlan(link_policies=("fastest",))
    with pytest.raises(PlanError, match="--link-rates"):
        WirePlan(link_rates_bps=(-1.0,))


def test_payload_is_exactly_the_bytes_asked_for():
    source = np.arange(10, dtype=np.float32)
    assert payload_of(16, source).tolist() == [0, 1, 2, 3]
    tiled = payload_of(48, source)
    assert tiled.nbytes == 48 and tiled.dtype == np.float32 and tiled.tolist() == [*range(10), 0, 1]
    with pytest.raises(ValueError, match="multiple of 4"):
        payload_of(6, source)


class _RecordingSocket:
    def __init__(self) -> None:
        self.calls: list[int] = []

    def sendmsg(self, buffers) -> int:
        n = sum(memoryview(b).nbytes for b in buffers)
        self.calls.append(n)
        return n


def test_paced_socket_passes_at_most_one_slice_per_call():
    recorder = _RecordingSocket()
    paced = PacedSocket(recorder, rate_bps=1e15, slice_bytes=1000)  # fast enough never to sleep noticeably
    assert paced.rate_bytes_per_s == 1e15 / 8
    buffers = [memoryview(bytes(700)), memoryview(bytes(700))]
    assert paced.sendmsg(buffers) == 1000 and recorder.calls == [1000]
    assert paced.sendmsg([memoryview(bytes(300))]) == 300
    with pytest.raises(ValueError, match="rate_bps"):
        PacedSocket(recorder, rate_bps=0)


def _link(policy: str, rate_bps: float | None, median_s: float, p25_s: float) -> dict:
    return {"policy": policy, "rate_bps": rate_bps, "message_s_median": median_s, "message_s_p25": p25_s}


def test_summary_of_a_known_report():
    report = {
        "frames": [
            {"size_bytes": 65536, "frames": {"none": {"vs_raw": 0.5}}},  # under 1 MiB: not a target
            {"size_bytes": 1048576, "frames": {"none": {"vs_raw": 0.95}}},
            {"size_bytes": 4194304, "frames": {"none": {"vs_raw": 0.91}}},
        ],
        "links": [
            _link("fixed:none", 1e8, 0.100, 0.090), _link("fixed:zstd-1", 1e8, 0.080, 0.075),
            _link("seed", 1e8, 0.120, 0.110), _link("network-aware", 1e8, 0.082, 0.075),
            _link("fixed:none", None, 0.010, 0.009), _link("fixed:zstd-1", None, 0.020, 0.018),
            _link("seed", None, 0.009, 0.008), _link("network-aware", None, 0.0120, 0.0099),
        ],
    }
    s = summarize(report)
    assert s["uncompressed_frames_vs_raw_from_1MiB"] == {"1048576": 0.95, "4194304": 0.91}
    assert s["uncompressed_frames_target_0_90_met"] is True
    assert list(s["links"]) == ["unpaced", "100000000"]
    at_100 = s["links"]["100000000"]
    assert at_100["best_fixed"] == "fixed:zstd-1" and at_100["network_aware_vs_best_fixed"] == pytest.approx(1.025)
    assert at_100["within_5pct_of_best_fixed"] is True and at_100["beats_seed"] is True
    assert at_100["network_aware_vs_best_fixed_p25"] == pytest.approx(1.0)
    unpaced = s["links"]["unpaced"]
    assert unpaced["best_fixed"] == "fixed:none" and unpaced["network_aware_vs_best_fixed"] == pytest.approx(1.2)
    assert unpaced["within_5pct_of_best_fixed"] is False and unpaced["beats_seed"] is False
    assert summarize({"frames": [report["frames"][1] | {"frames": {"none": {"vs_raw": 0.89}}}]})[
        "uncompressed_frames_target_0_90_met"] is False


def test_the_peer_loads_without_the_host_only_packages():
    """The node image has no rich, docker, scipy, PyYAML, Jinja2 or matplotlib: the peer must not need them."""
    import subprocess
    import sys

    from harness import REPO_ROOT

    code = ("import sys\n"
            "for name in ('rich', 'docker', 'scipy', 'yaml', 'jinja2', 'matplotlib'):\n"
            "    sys.modules[name] = None\n"
            "sys.argv = ['x', 'peer', '--help']\n"
            "import runpy; runpy.run_module('harness.bench.wire', run_name='__main__')\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "--role {sink,source}" in out.stdout


def test_iperf3_json_is_parsed_and_its_errors_named():
    import json

    from harness.bench.wire.iperf import Iperf3Error, parse_result

    doc = {"start": {"version": "iperf 3.12"},
           "end": {"sum_sent": {"bytes": 1_000_000, "seconds": 0.5, "retransmits": 3},
                   "sum_received": {"bytes": 1_000_000, "seconds": 0.25}}}
    assert parse_result(json.dumps(doc)) == {"bytes": 1_000_000, "seconds": 0.25, "bytes_per_s": 4_000_000.0,
                                             "figure": "receiver", "retransmits": 3, "version": "iperf 3.12"}
    doc["end"]["sum_received"] = {"bytes": 0, "seconds": 0.001}  # a short transfer: the server's totals not in
    assert parse_result(json.dumps(doc))["figure"] == "sender"
    assert parse_result(json.dumps(doc))["bytes_per_s"] == 2_000_000.0
    for text, says in (("not json", "no JSON"), ('{"error": "unable to connect to server"}', "unable to connect"),
                       ('{"end": {}}', "no received or sent totals"), ("[1]", "not an object")):
        with pytest.raises(Iperf3Error, match=says):
            parse_result(text)


def test_sections_and_frame_codecs_options():
    plan = plan_from_args(_args("--sections", "frames", "--frame-codecs", "none,int8"))
    assert plan.sections == ("frames",) and plan.frame_codecs == ("none", "int8")
    with pytest.raises(SpecError, match="--sections"):
        plan_from_args(_args("--sections", "frames,nonsense"))


@pytest.mark.parametrize("send, recv", [("sendmsg-split", "whole"), ("sendall", "framed"),
                                        ("sendmsg-split", "framed")])
@pytest.mark.parametrize("size", [100, 150, 151, 70_000])
def test_frame_shaped_raw_loops_deliver_every_byte(send, recv, size):
    import socket
    import threading

    from harness.bench.wire.raw import RAW_CHUNK_BYTES, recv_raw, send_raw

    payload = bytes(range(256)) * (size // 256 + 1)
    message = memoryview(payload[:size])
    a, b = socket.socketpair()
    got = bytearray(size)
    try:
        sender = threading.Thread(target=send_raw, args=(a, message, 3, send))
        sender.start()
        recv_raw(b, memoryview(got), size, 3, recv, RAW_CHUNK_BYTES)
        sender.join()
        b.setblocking(False)
        with pytest.raises(BlockingIOError):  # exactly 3 x size bytes were sent and taken
            b.recv(1)
    finally:
        a.close()
        b.close()
    assert bytes(got) == payload[:size]  # the last of the 3 messages, whole and in order


def test_a_bench_killed_with_sigterm_unwinds_as_on_ctrl_c(monkeypatch):
    """`wiiide-lab bench-*` turns SIGTERM into KeyboardInterrupt: the bench's ``finally`` (where run_pair
    removes its containers) runs, the verb exits 130, and the previous SIGTERM handler is back after."""
    import os
    import signal
    import sys
    import time
    import types

    import harness.cli as cli

    cleaned = []

    def main_from_args(args, log):
        try:
            os.kill(os.getpid(), signal.SIGTERM)  # the handler runs in this thread before the next line
            time.sleep(1.0)
            raise AssertionError("SIGTERM did not interrupt the bench")
        finally:
            cleaned.append(True)

    fake = types.ModuleType("fake_bench")
    fake.main_from_args = main_from_args
    monkeypatch.setitem(sys.modules, "fake_bench", fake)
    def unhandled(signum, frame):  # what the test process gets if the verb does not take SIGTERM itself
        raise RuntimeError("SIGTERM reached the handler in force before the bench")

    args = cli.build_parser().parse_args(["bench-wire"])
    args.bench_module = "fake_bench"
    monkeypatch.setattr(cli, "build_parser", lambda: types.SimpleNamespace(parse_args=lambda argv: args))
    original = signal.signal(signal.SIGTERM, unhandled)
    try:
        assert cli.main([]) == 130
        assert signal.getsignal(signal.SIGTERM) is unhandled
    finally:
        signal.signal(signal.SIGTERM, original)
    assert cleaned == [True]


def test_trial_orders_put_every_kind_in_every_slot():
    """Each repeat runs every kind once; over as many repeats as kinds, each kind takes each slot once,
    and the first repeat keeps the listed order (raw variants, iperf3, frames)."""
    orders = trial_orders(5, 7)
    assert len(orders) == 7 and orders[0] == [0, 1, 2, 3, 4]
    assert all(sorted(order) == [0, 1, 2, 3, 4] for order in orders)
    for slot in range(5):
        assert sorted(order[slot] for order in orders[:5]) == [0, 1, 2, 3, 4]
    assert trial_orders(3, 0) == [] and trial_orders(1, 2) == [[0], [0]]
