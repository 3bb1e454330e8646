"""The report table's figures against ddp (harness.present.table.baseline_cells): each point's median
samples/s and time to target over those of the ddp point with the same other params."""

from __future__ import annotations

import re

from harness.present.table import VS_BASELINE_COLUMN, format_table
from harness.results.report import ReportWriter, load_report
from harness.results.totals import repeat_held_out, repeat_totals
from wiiide.training.evaluation import Evaluation, HeldOutCurve

HEADER = {"name": "vs", "machine_info": {"cpu_count_logical": 2}, "commit_info": {"id": "abc"},
          "backend": {"name": "local"}, "param_names": ["link", "engine"],
          "spec": {"name": "vs", "repeats": 2, "axes": {"link": ["a", "b"], "engine": ["central", "ddp"]}}}


def _nodes(samples_per_s: float, reached_at_s: float | None) -> dict[str, dict]:
    """A coordinator with this throughput whose held-out curve (every 0.5 s) first reaches 0.9 at
    `reached_at_s` (None: never)."""
    curve = HeldOutCurve("accuracy", True, 0.9)
    for i in range(8):
        reached = reached_at_s is not None and 0.5 * i >= reached_at_s
        curve.add(Evaluation(t_s=0.5 * i, step=10 * i, samples=320 * i, value=0.95 if reached else 0.5,
                             eval_s=0.001))
    held = {**curve.to_dict(), "eval_every_s": 0.5, "skipped_busy": 0, "error": None}
    return {"coordinator": {"role": "coordinator", "steps": 100, "batches": 200, "samples": 6400,
                            "train_time_s": 4.0, "test_accuracy": 0.95, "held_out": held,
                            "time_to_target_s": held["time_to_target_s"],
                            "training_summary": {"throughput_samples_per_s": samples_per_s}}}


def _report(tmp_path, points: list[tuple[dict, list[tuple[float, float | None]]]], header=HEADER):
    path = tmp_path / "vs-1" / "report.json"
    writer = ReportWriter(path, header)
    for index, (params, repeats) in enumerate(points):
        point = writer.start_point(index, params, params)
        for r, (rate, reached) in enumerate(repeats):
            nodes = _nodes(rate, reached)
            writer.add_repeat(point, {"repeat": r, "status": "ok", "totals": repeat_totals(nodes, {}),
                                      "held_out": repeat_held_out(nodes), "nodes": nodes})
        writer.finish_point(point)
    writer.finish(complete=True)
    return load_report(path)


def _rows(table: str) -> dict[tuple[str, str], list[str]]:
    return {(cells[1], cells[2]): cells for cells in (line.split() for line in table.splitlines())
            if re.match(r"\s*\d\s", " ".join(cells))}


def test_each_point_against_the_ddp_point_of_its_group(tmp_path):
    report = _report(tmp_path, [
        ({"link": "a", "engine": "central"}, [(300.0, 1.0), (500.0, 2.0)]),  # medians 400 samples/s, 1.5 s
        ({"link": "a", "engine": "ddp"}, [(200.0, 3.0), (200.0, 3.0)]),
        ({"link": "b", "engine": "central"}, [(90.0, None), (110.0, None)]),  # never reached
        ({"link": "b", "engine": "ddp"}, [(50.0, 2.0), (50.0, 2.0)]),
    ])
    table = format_table(report)
    header = next(line for line in table.splitlines() if "status" in line).split()
    assert header[header.index("n") + 1:header.index("n") + 7] == ["samples/s", "vs", "ddp", "to", "target", "vs"]
    rows = _rows(table)
    assert rows[("a", "central")][5:7] == ["2.00x", "0.50x"]  # 400 / 200 samples/s; 1.5 s / 3.0 s
    assert rows[("a", "ddp")][5:7] == ["baseline", "baseline"]
    assert rows[("b", "central")][5:7] == ["2.00x", "-"]  # no time to target to set against ddp's
    assert "above 1.00x and time to target below 1.00x beat ddp" in table


def test_no_such_column_without_ddp_or_an_engine_axis(tmp_path):
    header = {**HEADER, "param_names": ["engine"], "spec": {"name": "vs", "repeats": 1,
                                                            "axes": {"engine": ["central", "sharded"]}}}
    report = _report(tmp_path, [({"engine": "central"}, [(300.0, 1.0)]), ({"engine": "sharded"}, [(400.0, 1.0)])],
                     header)
    assert VS_BASELINE_COLUMN not in format_table(report) and "vs ddp" not in format_table(report)


def test_a_group_without_its_ddp_point_shows_no_ratio(tmp_path):
    report = _report(tmp_path, [
        ({"link": "a", "engine": "central"}, [(300.0, None)]),
        ({"link": "a", "engine": "ddp"}, [(100.0, None)]),
        ({"link": "b", "engine": "central"}, [(300.0, None)]),
    ])
    rows = _rows(format_table(report))
    assert rows[("a", "central")][5:7] == ["3.00x", "-"] and rows[("b", "central")][5:7] == ["-", "-"]


def test_the_html_table_has_the_same_cells_under_its_headers(tmp_path):
    from harness.present.html import render_page

    report = _report(tmp_path, [({"link": "a", "engine": "central"}, [(300.0, 1.0)]),
                                ({"link": "a", "engine": "ddp"}, [(100.0, 2.0)])])
    page = render_page([("vs-1", report)])
    head = re.findall(r"<th[^>]*>([^<]*)</th>", page)
    assert head.index("samples/s vs ddp") == head.index("n ok") + 1 and "to target vs ddp" in head
    assert re.search(r"<td>3.00x</td><td>0.50x</td>", page) and "beat ddp" in page
