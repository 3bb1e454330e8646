"""The MLPerf-style reading of times to target (harness.present.time_to_train) on fixed inputs."""

from __future__ import annotations

import pytest

from harness.present.time_to_train import time_to_train


def test_five_runs_drop_the_fastest_and_the_slowest():
    reading = time_to_train([12.0, 10.0, 30.0, 11.0, 13.0])
    assert reading.olympic_mean_s == pytest.approx(12.0)  # (11 + 12 + 13) / 3, 10 and 30 dropped
    assert reading.median_s == 12.0 and reading.valid and reading.not_converged == 0


def test_one_run_that_never_converged_is_the_one_dropped_as_slowest():
    reading = time_to_train([20.0, None, 10.0, 40.0, 30.0])
    assert reading.olympic_mean_s == pytest.approx(30.0)  # 10 dropped, the failure dropped: (20 + 30 + 40) / 3
    assert (reading.converged, reading.not_converged, reading.valid) == (4, 1, True)
    assert reading.median_s == 25.0


def test_two_runs_that_never_converged_make_the_point_invalid():
    reading = time_to_train([20.0, None, 10.0, None, 30.0])
    assert not reading.valid and reading.olympic_mean_s is None and reading.not_converged == 2


def test_fewer_than_three_runs_have_no_olympic_mean():
    assert time_to_train([5.0, 6.0]).olympic_mean_s is None


def test_bootstrap_interval_brackets_the_mean_and_is_repeatable():
    times = [9.0, 10.0, 11.0, 10.5, 9.5]
    a, b = time_to_train(times), time_to_train(times)
    assert a.ci_low_s < 10.0 < a.ci_high_s and 9.0 <= a.ci_low_s and a.ci_high_s <= 11.0
    assert (a.ci_low_s, a.ci_high_s) == (b.ci_low_s, b.ci_high_s)
    assert time_to_train([7.0, 7.0, 7.0]).ci_low_s is None  # no spread: no interval


def test_runs_outside_the_reference_range_are_flagged():
    reading = time_to_train([3.0, 10.0, None, 12.0, 40.0], reference_range_s=(8.0, 20.0))
    assert reading.outside_reference == (0, 4)


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError):
        time_to_train([1.0, -2.0, 3.0])
    with pytest.raises(ValueError):
        time_to_train([1.0, 2.0, 3.0], reference_range_s=(5.0, 1.0))


def test_compare_shows_the_mlperf_reading_of_five_repeats(tmp_path):
    from harness.present.compare import compare_engines
    from harness.results.report import load_report
    from tests.unit.test_time_to_target_report import _report

    # evaluations every 0.5 s: a repeat reaches 0.9 at the first value >= 0.9
    runs = {"wiiide": [[0.1, 0.95], [0.1, 0.5, 0.91], [0.1, 0.5, 0.6, 0.93], [0.1, 0.2, 0.3, 0.4, 0.95],
                       [0.1, 0.2]],  # 0.5, 1.0, 1.5, 2.0 s and one that never converged
            "ddp": [[0.1, 0.5, 0.91], [0.1, 0.5, 0.92], [0.1, 0.5, 0.6, 0.93], [0.1, 0.5, 0.6, 0.93],
                    [0.1, 0.5, 0.94]]}  # 1.0, 1.0, 1.5, 1.5, 1.0 s
    path = _report(tmp_path, runs)
    rows = {r.label: r for r in compare_engines(load_report(path), baseline="ddp")}
    # wiiide: 0.5 and the failure dropped, (1.0 + 1.5 + 2.0) / 3 = 1.5; median of 0.5..2.0 = 1.25; the
    # reference (ddp) converged in 1.0..1.5 s, so 0.5 s and 2.0 s are outside it
    assert rows["wiiide"].mlperf.startswith("1.5 [med 1.25, CI ")
    assert rows["wiiide"].mlperf.endswith(" 1 not conv. 2 outside ref!")
    assert rows["ddp"].mlperf.startswith("1.17 [med 1, CI ")  # (1.0 + 1.0 + 1.5) / 3


def test_the_report_page_shows_the_mlperf_column_for_points_with_a_target(tmp_path):
    pytest.importorskip("matplotlib")
    from harness.present.html import render_page
    from harness.results.report import load_report
    from tests.unit.test_time_to_target_report import _report

    page = render_page([("ttt-1", load_report(_report(tmp_path)))])
    assert "MLPerf s" in page and "MLPerf needs &gt;= 3" in page  # 2 repeats per point: too few to read
