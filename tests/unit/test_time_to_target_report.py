"""Time to target in the results and present stages: the held-out curve per repeat, time to target in
the totals and the points' medians, "not reached", older reports without curves, the text table,
`harness compare` and the HTML page's held-out chart."""

from __future__ import annotations

import base64
import io
import json
import re

import pytest

from harness.present.compare import compare, compare_engines
from harness.present.table import format_table
from harness.results.report import ReportWriter, load_report, parse_report
from harness.results.totals import repeat_held_out, repeat_totals
from tests.report_samples import buffers_report, report_validator
from wiiide.training.evaluation import Evaluation, HeldOutCurve

HEADER = {"name": "ttt", "machine_info": {"cpu_count_logical": 2}, "commit_info": {"id": "abc"},
          "backend": {"name": "local"}, "spec": {"name": "ttt", "repeats": 2, "axes": {"engine": ["wiiide", "ddp"]}},
          "param_names": ["engine"]}


def _nodes(values: list[float], every_s: float = 0.5, target: float | None = 0.9) -> dict[str, dict]:
    """A coordinator whose held-out record is what wiiide.training.evaluation writes for these accuracies."""
    curve = HeldOutCurve("accuracy", True, target)
    for i, v in enumerate(values):
        curve.add(Evaluation(t_s=every_s * i, step=20 * i, samples=1280 * i, value=v, eval_s=0.002))
    held = {**curve.to_dict(), "eval_every_s": every_s, "skipped_busy": 0, "error": None}
    coord = {"role": "coordinator", "steps": 100, "batches": 200, "samples": 6400, "train_time_s": 5.0,
             "test_accuracy": values[-1], "held_out": held, "time_to_target_s": held["time_to_target_s"],
             "training_summary": {"throughput_samples_per_s": 1000.0}}
    return {"coordinator": coord}


def _report(tmp_path, runs: dict[str, list[list[float]]] | None = None):
    """By default engine wiiide reaches 0.9 in both repeats (at 1.0 s and 1.5 s), ddp in one of two (at
    2.0 s), fsdp in neither; `runs`: engine -> each repeat's held-out accuracies (every 0.5 s)."""
    runs = runs or {"wiiide": [[0.1, 0.7, 0.92, 0.95], [0.1, 0.6, 0.85, 0.91]],
                    "ddp": [[0.1, 0.5, 0.8, 0.88, 0.93], [0.1, 0.4, 0.7, 0.8, 0.85]],
                    "fsdp": [[0.1, 0.3, 0.5], [0.1, 0.2, 0.6]]}
    path = tmp_path / "ttt-1" / "report.json"
    repeats = max(len(r) for r in runs.values())
    writer = ReportWriter(path, {**HEADER, "spec": {**HEADER["spec"], "repeats": repeats}})
    for index, (engine, repeats) in enumerate(runs.items()):
        point = writer.start_point(index, {"engine": engine}, {"engine": engine})
        for r, values in enumerate(repeats):
            nodes = _nodes(values)
            writer.add_repeat(point, {"repeat": r, "status": "ok", "totals": repeat_totals(nodes, {}),
                                      "held_out": repeat_held_out(nodes), "nodes": nodes})
        writer.finish_point(point)
    writer.finish(complete=True)
    return path


def test_time_to_target_per_repeat_and_median_per_point(tmp_path):
    report = load_report(_report(tmp_path))
    wiiide, ddp, fsdp = report.points
    assert [r.totals.time_to_target_s for r in wiiide.repeats] == [1.0, 1.5]
    assert wiiide.summary["time_to_target_s"].median == 1.25
    assert [r.totals.target_reached for r in ddp.repeats] == [True, False]
    assert ddp.summary["time_to_target_s"].count == 1 and ddp.summary["time_to_target_s"].median == 2.0
    assert "time_to_target_s" not in fsdp.summary  # not reached: no figure, and it says so below
    assert [r.totals.time_to_target_s for r in fsdp.repeats] == [None, None]
    held = wiiide.repeats[0].held_out
    assert held.metric == "accuracy" and held.target == 0.9 and held.step_at_target == 40
    assert [(p.t_s, p.value) for p in held.curve] == [(0.0, 0.1), (0.5, 0.7), (1.0, 0.92), (1.5, 0.95)]


def test_round_trip_schema_and_reports_without_curves(tmp_path):
    path = _report(tmp_path)
    report = load_report(path)
    assert parse_report(json.loads(json.dumps(report.to_json_dict()))) == report
    report_validator().validate(json.loads(path.read_text()))
    old = parse_report({**buffers_report(), "schema_version": 2})  # written before curves existed
    assert all(r.held_out is None and r.totals.time_to_target_s is None for p in old.points for r in p.repeats)
    assert "to target" not in format_table(old)  # no column when no point asked for a target
    assert repeat_held_out({"coordinator": {"steps": 3}}) is None


def test_table_and_compare_show_time_to_target_and_not_reached(tmp_path):
    path = _report(tmp_path)
    table = format_table(load_report(path))
    rows = {line.split()[1]: line for line in table.splitlines() if re.match(r"\s*\d\s", line)}
    assert "to target s" in table and "first held-out evaluation" in table
    assert rows["wiiide"].rstrip().endswith("1.25±0.354!")  # median of 1.0 and 1.5, spread over 10 %
    assert rows["ddp"].rstrip().endswith("2 (1/2)")
    assert rows["fsdp"].rstrip().endswith("not reached")
    by_engine = {r.label: r for r in compare_engines(load_report(path), baseline="wiiide")}
    assert (by_engine["ddp"].to_target, by_engine["fsdp"].to_target) == ("2 (1/2)", "not reached")
    text = compare([str(path)], metric="time_to_target_s", baseline="wiiide")
    assert "to target s" in text and "not reached" in text
    assert by_engine["ddp"].extra["time_to_target_s"] == 2.0


def test_html_plots_the_held_out_metric_against_wall_time(tmp_path):
    image = pytest.importorskip("matplotlib.image")
    from harness.present.html import render_page

    page = render_page([("ttt-1", load_report(_report(tmp_path)))])
    match = re.search(r'<img src="data:image/png;base64,([^"]+)" alt="held-out accuracy against wall time">', page)
    assert match, "no held-out chart on the page"
    assert image.imread(io.BytesIO(base64.b64decode(match.group(1)))).shape[1] == 800  # 8 in at 100 dpi
    assert "not reached" in page and "to target s" in page
    no_curves = render_page([("old", buffers_report())])
    assert "held-out accuracy against wall time" not in no_curves
