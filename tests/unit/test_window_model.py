"""The window model read off synthetic sweep reports whose answers are known by construction."""

import json

import pytest

from harness.analysis import window_model as wm
from harness.links.window import parse_output

MIB = 1 << 20


def _repeat(readback_bytes, rtt_ms, measured_bps, rate_bps=1_000_000_000, adv_win_scale="1", error=None):
    probe = {"sndbuf_requested_bytes": readback_bytes // 2, "rcvbuf_requested_bytes": readback_bytes // 2,
             "sndbuf_bytes": readback_bytes, "rcvbuf_bytes": readback_bytes, "throughput_bps": measured_bps,
             "sysctls": {"net.ipv4.tcp_adv_win_scale": [adv_win_scale] if adv_win_scale else None}}
    if error:
        probe = {"error": error}
    return {"repeat": 0, "nodes": {"coordinator": {"goodput_bps": 3.0e8}},
            "links": {"rtt_probe": {"median_rtt_ms": rtt_ms},
                      "window_probe": probe,
                      "containers": {"c-coordinator-1": {"role": "coordinator", "worker_index": None,
                                                         "applied_rate_bps": rate_bps},
                                     "c-worker-1": {"role": "worker", "worker_index": 1,
                                                    "applied_rate_bps": rate_bps}}}}


def _report(*repeats):
    return {"points": [{"params": {"buffer_bytes": f"{i}"}, "repeats": [r]} for i, r in enumerate(repeats)]}


def test_a_window_bound_point_whose_throughput_is_window_over_rtt_has_no_error():
    # read back 2 MiB -> 1 MiB of data at tcp_adv_win_scale 1; 1 MiB per 50 ms = 167,772,160 bit/s
    (row,) = wm.report_rows(_report(_repeat(2 * MIB, 50.0, 167_772_160.0)))
    assert row.bound == "window"
    assert row.window_bytes == MIB
    assert row.model_bps == pytest.approx(167_772_160.0)
    assert row.error == pytest.approx(0.0, abs=1e-12)


def test_a_point_whose_window_exceeds_the_bdp_is_rate_bound():
    # 16 MiB of data over 50 ms is 2.7 Gbit/s: the 1 Gbit/s link binds; measured 0.95 Gbit/s
    (row,) = wm.report_rows(_report(_repeat(32 * MIB, 50.0, 950_000_000.0)))
    assert (row.bound, row.model_bps) == ("rate", 1e9)
    assert row.error == pytest.approx(1 / 0.95 - 1)


def test_the_smaller_buffer_sets_the_window():
    rep = _repeat(8 * MIB, 100.0, 1e8)
    rep["links"]["window_probe"]["rcvbuf_bytes"] = 2 * MIB
    (row,) = wm.report_rows(_report(rep))
    assert row.window_bytes == MIB


@pytest.mark.parametrize("scale, fraction", [(1, 0.5), (2, 0.75), (0, 1.0), (-2, 0.25)])
def test_the_share_of_a_buffer_for_data_follows_tcp_adv_win_scale(scale, fraction):
    assert wm.data_fraction(scale) == fraction


def test_an_unrecorded_sysctl_falls_back_to_the_default_and_says_so():
    (row,) = wm.report_rows(_report(_repeat(2 * MIB, 50.0, 1e8, adv_win_scale=None)))
    assert (row.adv_win_scale, row.adv_win_scale_recorded) == (1, False)
    assert "assumed" in wm.render([row])


def test_repeats_without_a_delay_or_with_a_failed_probe_are_left_out():
    unshaped = {"repeat": 0, "links": {}}
    failed = _repeat(2 * MIB, 50.0, 1e8, error="window probe failed")
    assert wm.report_rows(_report(unshaped, failed)) == []
    assert "no repeat" in wm.render([])


def test_out_of_range_inputs_are_refused():
    with pytest.raises(ValueError):
        wm.data_fraction(32)
    with pytest.raises(ValueError):
        wm.model_bps(1e9, MIB, 0.0)


def test_the_command_prints_the_rows_and_exits_2_on_a_bad_report(tmp_path, capsys):
    (tmp_path / "report.json").write_text(json.dumps(_report(_repeat(2 * MIB, 50.0, 167_772_160.0))))
    assert wm.main([str(tmp_path), "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["bound"] == "window" and row["measured_bps"] == 167_772_160.0
    (tmp_path / "bad.json").write_text("{")
    assert wm.main([str(tmp_path / "bad.json")]) == 2


def test_the_probe_output_is_parsed_and_bad_output_refused():
    record = parse_output('{"throughput_bps": 5e8, "rcvbuf_bytes": 2097152, "sysctls": {}}\n',
                          '{"sndbuf_bytes": 2097152}\n')
    assert (record["throughput_bps"], record["sndbuf_bytes"]) == (5e8, 2097152)
    with pytest.raises(ValueError, match="sink printed no JSON"):
        parse_output("Traceback ...", '{"sndbuf_bytes": 1}')
    with pytest.raises(ValueError, match="not a number"):
        parse_output('{"throughput_bps": -1}', '{"sndbuf_bytes": 1}')


def test_the_report_table_shows_the_window_probe_beside_the_model():
    from harness.present.table import format_table

    repeat = {"status": "ok", **_repeat(2 * MIB, 50.0, 150_000_000.0)}
    del repeat["nodes"]
    report = {"name": "buffers", "param_names": ["buffer_bytes"], "complete": True, "points": [
        {"index": 0, "params": {"buffer_bytes": "1MiB"}, "cluster": {"link": {"label": "gbit-rtt50ms"}},
         "status": "ok", "error": None, "repeats": [repeat], "summary": {}, "unstable": []}]}
    text = format_table(report)
    assert "window" in text and "150 (168)" in text  # measured 150 Mbit/s; the model: 1 MiB per 50 ms
    report["points"][0]["repeats"][0]["links"].pop("window_probe")
    assert "150 (168)" not in format_table(report)


def test_the_kernels_own_window_gives_a_second_reading():
    # the receiver kept 2,000,000 B of its 2 MiB read-back as window: 2e6 B per 50 ms = 320 Mbit/s
    rep = _repeat(2 * MIB, 50.0, 320_000_000.0)
    rep["links"]["window_probe"]["receiver_window_bytes"] = 2_000_000
    (row,) = wm.report_rows(_report(rep))
    assert (row.kernel_window_bytes, row.kernel_model_bps) == (2_000_000, pytest.approx(3.2e8))
    assert row.kernel_error == pytest.approx(0.0, abs=1e-12)
    assert row.error == pytest.approx(167_772_160 / 3.2e8 - 1)  # the documented half: 1 MiB per 50 ms


def test_the_receivers_window_is_read_from_ss():
    from harness.links.window import receiver_window_bytes
    line = "skmem:(r1512781,rb2097152,t0) bbr rcv_space:654830 rcv_ssthresh:1833528 minrtt:0.025"
    assert receiver_window_bytes(line) == 1833528
    assert receiver_window_bytes("") is None
