"""The results stage: typed reports, totals and statistics computed in one place, the atomic writer,
loading version-1 reports, and the shipped JSON Schema."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from harness.errors import HarnessError
from harness.present.table import format_table, render_table
from harness.results.models import Report, Totals
from harness.results.report import (
    SCHEMA_VERSION,
    ReportWriter,
    load_report,
    load_report_json,
    parse_report,
)
from harness.results.schema import (
    NODE_METRICS_SCHEMA_PATH,
    SCHEMA_PATH,
    main as schema_main,
    node_metrics_schema,
    report_json_schema,
    schema_text,
)
from harness.results.totals import point_summary, repeat_totals, summary_stats
from tests.report_samples import buffers_report, report_validator

HEADER = {"name": "tiny", "machine_info": {"cpu_count_logical": 2, "memory_total_bytes": 2**33, "kernel": "6.1"},
          "commit_info": {"id": "0123456789abcdef", "dirty": False}, "backend": {"name": "local"},
          "spec": {"name": "tiny", "description": "two codecs", "repeats": 2, "axes": {"compression": ["none"]}},
          "param_names": ["compression"]}


def _nodes(batches: int = 200, train_s: float = 10.0) -> dict[str, dict]:
    """A parameter server and two workers as their metrics files have them (wiiide.metrics)."""
    coord = {"role": "coordinator", "steps": batches // 2, "batches": batches, "samples": batches * 32,
             "train_time_s": train_s, "payload_bytes_sent": 3_000_000, "payload_bytes_received": 1_000_000,
             "wire_bytes_sent": 3_100_000, "wire_bytes_received": 1_050_000, "encoded_bytes_sent": 3_000_000,
             "test_accuracy": 0.91, "loss_final": 0.3, "step_time_s": {"median": 0.05, "mean": 0.05},
             "peak_rss_bytes": 300_000_000, "num_workers": 2, "gradient_bytes": 10_000}
    workers = {f"worker-{i}": {"role": "worker", "steps": batches // 2, "batches": batches // 2,
                               "network_time_s": float(i), "payload_bytes_sent": 500_000,
                               "encoded_bytes_sent": 250_000, "peak_rss_bytes": 100_000_000,
                               "compute_time_s": 2.0} for i in (1, 2)}
    return {"coordinator": coord, **workers}


def _containers(rx: int, tx: int) -> dict[str, dict]:
    return {name: {"role": role, "kind": "container", "exit_code": 0, "samples": [],
                   "summary": {"net_rx_bytes": rx, "net_tx_bytes": tx}}
            for name, role in (("c1", "coordinator"), ("w1", "worker"))}


# --- totals ----------------------------------------------------------------------------------------
def test_repeat_totals_of_a_parameter_server_run():
    t = repeat_totals(_nodes(), _containers(1000, 3000))
    assert isinstance(t, Totals)
    assert t.batches_per_s == 20.0 and t.samples_per_s == 640.0  # 200 batches, 6400 samples in 10 s
    assert t.goodput_bytes_per_s == 400_000.0  # 3 MB out + 1 MB in through the coordinator, over 10 s
    assert t.wire_bytes_per_s == 415_000.0
    assert t.compression_ratio == pytest.approx(4_000_000 / 3_500_000)  # raw sent / encoded sent, all nodes
    assert t.worker_network_time_s == 1.5 and t.peak_rss_bytes == 300_000_000
    assert (t.container_net_rx_bytes, t.container_net_tx_bytes, t.container_net_bytes) == (2000, 6000, 8000)
    assert t.engine == "wiiide" and t.world_size == 3
    assert t.comm_share == pytest.approx(1 - (2.0 / 100) / 0.05)  # 1 - worker compute per step / step time
    assert t.link_rate_bps is None  # no link shaped
    local = repeat_totals(_nodes(), {"p": {"kind": "process", "summary": {"net_rx_bytes": None}}})
    assert local.container_net_bytes is None and local.comm_measured_bytes_per_step is None
    nothing = repeat_totals({}, {})
    assert nothing.batches_per_s is None and nothing.goodput_bytes_per_s is None and nothing.steps is None


def test_summary_statistics_and_the_unstable_flag():
    stats = summary_stats([90.0, 110.0, 130.0])
    assert (stats.count, stats.mean, stats.stdev, stats.median, stats.min, stats.max) == (3, 110, 20, 110, 90, 130)
    assert stats.unstable  # stdev 20 is 18 % of the mean
    assert not summary_stats([100.0, 109.0]).unstable  # stdev 6.36 is 6.1 % of 104.5
    one = summary_stats([5.0])
    assert one.stdev == 0.0 and not one.unstable
    assert summary_stats([]).count == 0 and summary_stats([]).mean is None

    report = parse_report(buffers_report())
    partial = report.points[2]  # 8MiB: repeats ok (450), failed, ok (470)
    summary, unstable = point_summary(partial.repeats)
    assert summary["batches_per_s"].count == 2 and summary["batches_per_s"].median == 460.0
    assert "container_net_bytes" in summary and "throughput_samples_per_s" not in summary  # no repeat has it
    assert unstable == ["worker_network_time_s"]  # 12 s and 14 s: stdev 1.41 is 10.9 % of 13
    assert point_summary(report.points[3].repeats) == ({}, [])  # nothing ok


# --- writer and loader -----------------------------------------------------------------------------
def test_writer_saves_a_complete_report_after_every_repeat(tmp_path):
    path = tmp_path / "tiny-1" / "report.json"
    writer = ReportWriter(path, HEADER)
    writer.save()
    point = writer.start_point(0, {"compression": "none"}, {"num_workers": 2}, cluster={"link": None})
    ok = writer.add_repeat(point, {"repeat": 0, "status": "ok", "error": None, "elapsed_s": 12.0,
                                   "totals": repeat_totals(_nodes(200), {}), "nodes": _nodes(200)})
    assert ok.totals.batches_per_s == 20.0
    on_disk = load_report(path)  # rewritten at once, whole
    assert on_disk.points[0].status == "running" and on_disk.points[0].summary["batches_per_s"].median == 20.0
    writer.add_repeat(point, {"repeat": 1, "status": "failed", "error": "timed out after 90 s"})
    writer.finish_point(point)
    assert point.status == "partial" and point.error == "repeat 1: timed out after 90 s"
    writer.finish(complete=False, note="interrupted by SIGINT after 2 of 4 runs")
    assert not list(path.parent.glob(".report.json.*"))  # no temporary file left behind

    data = json.loads(path.read_text())
    assert data["schema_version"] == SCHEMA_VERSION == 2
    assert data["points"][0]["repeats"][1]["totals"]["batches_per_s"] is None  # every key, null when not measured
    assert data["complete"] is False and data["note"].startswith("interrupted")

    resumed = ReportWriter.resume(path.parent / "report.json")
    assert len(resumed.report.resumed_at_utc) == 1
    assert resumed.finished_point(0, {"compression": "none"}) is None  # partial: runs again
    again = resumed.start_point(0, {"compression": "none"}, {"num_workers": 2})
    resumed.add_repeat(again, {"repeat": 0, "status": "ok", "totals": repeat_totals(_nodes(100), {})})
    resumed.finish_point(again)
    assert resumed.finished_point(0, {"compression": "none"}) is again and len(resumed.report.points) == 1


def test_a_point_interrupted_between_its_repeats_is_resumed_with_the_repeats_it_has(tmp_path):
    """An interrupt after 1 of 3 ok repeats leaves the point partial (not skipped on resume); the resumed
    sweep keeps that repeat when the point's params and config are the same, and starts it empty when
    the config changed or a repeat had failed."""
    path = tmp_path / "tiny-1" / "report.json"
    writer = ReportWriter(path, HEADER)
    config = {"num_workers": 2, "hidden_sizes": (512, 512)}  # a tuple: compared as JSON gives it back
    point = writer.start_point(0, {"compression": "none"}, config)
    writer.add_repeat(point, {"repeat": 0, "status": "ok", "totals": repeat_totals(_nodes(200), {})})
    writer.finish_point(point, repeats=3)
    assert point.status == "partial" and point.error == "interrupted after 1 of 3 repeats"
    writer.finish(complete=False, note="interrupted")

    resumed = ReportWriter.resume(path, {"id": "abc123", "branch": "main", "time": None, "dirty": False})
    assert [c.id for c in resumed.report.resumed_commit_info] == ["abc123"]  # the runs after it are of that commit
    assert resumed.finished_point(0, {"compression": "none"}, 3) is None
    again = resumed.start_point(0, {"compression": "none"}, config, keep_repeats=True)
    assert [r.repeat for r in again.repeats] == [0] and again.summary["batches_per_s"].count == 1
    for repeat in (1, 2):
        resumed.add_repeat(again, {"repeat": repeat, "status": "ok", "totals": repeat_totals(_nodes(100), {})})
    resumed.finish_point(again, repeats=3)
    assert again.status == "ok" and resumed.finished_point(0, {"compression": "none"}, 3) is again
    assert load_report(path).points[0].summary["batches_per_s"].count == 3

    # another config (the spec changed), no keep_repeats, or a failed repeat: the point starts empty
    assert resumed.start_point(0, {"compression": "none"}, {**config, "num_workers": 3}, keep_repeats=True).repeats == []
    kept = resumed.start_point(0, {"compression": "none"}, config, keep_repeats=True)
    assert kept.repeats == [] and resumed.finished_point(0, {"compression": "none"}) is None  # the last start emptied it
    resumed.add_repeat(kept, {"repeat": 0, "status": "failed", "error": "timed out"})
    resumed.finish_point(kept, repeats=3)
    assert kept.status == "failed"
    assert resumed.start_point(0, {"compression": "none"}, config, keep_repeats=True).repeats == []


def test_version_1_reports_load_as_version_2(tmp_path):
    v1 = buffers_report()
    assert v1["schema_version"] == 1 and v1["points"][3]["repeats"][0]["totals"] == {}
    path = tmp_path / "seed-buffers-1" / "report.json"
    path.parent.mkdir()
    path.write_text(json.dumps(v1))
    report = load_report(path.parent)
    assert isinstance(report, Report) and report.schema_version == SCHEMA_VERSION
    assert [p.status for p in report.points] == ["ok", "ok", "partial", "failed"]
    failed = report.points[3].repeats[0]
    assert not failed.ok and failed.totals.batches_per_s is None and "137" in failed.error
    assert report.points[0].summary["batches_per_s"].median == 300.0 and report.points[2].unstable
    # the samples and the nodes' own metrics come through, and unknown keys are kept
    coord = report.points[0].repeats[0].containers["wiiide_coordinator_1"]
    assert coord.role == "coordinator" and len(coord.samples) == 12 and coord.samples[0].memory_bytes == 290_000_000
    assert report.points[0].repeats[0].nodes["coordinator"]["socket_options"][0]["sndbuf_bytes"] == 2**21
    assert report.machine_info.wmem_max_bytes == 4194304 and report.backend.model_extra == {}
    # saved again it is version 2 and reads back the same
    assert parse_report(load_report_json(path)) == report
    assert "1MiB" in format_table(report) and "300±15.3" in format_table(report)


def test_a_report_with_unknown_keys_keeps_them():
    data = {**buffers_report(), "schema_version": 2, "made_by": "a newer harness"}
    data["points"][0]["repeats"][0]["totals"]["energy_joules"] = 12.5
    report = parse_report(data)
    assert report.made_by == "a newer harness"
    assert report.points[0].repeats[0].totals.figure("energy_joules") == 12.5
    dumped = report.to_json_dict()
    assert dumped["made_by"] == "a newer harness" and dumped["points"][0]["repeats"][0]["totals"]["energy_joules"] == 12.5


def test_bad_reports_fail_in_one_line_naming_the_field(tmp_path):
    with pytest.raises(HarnessError, match="schema_version 3 is not one this harness reads"):
        parse_report({**buffers_report(), "schema_version": 3})
    bad = buffers_report()
    bad["points"][1]["repeats"][0]["elapsed_s"] = "soon"
    with pytest.raises(HarnessError, match=r"x.json: points\.1\.repeats\.0\.elapsed_s: .*valid number.*soon"):
        parse_report(bad, "x.json")
    with pytest.raises(HarnessError, match="no 'points'"):
        parse_report({"name": "x"})
    (tmp_path / "r.json").write_text("{not json")
    with pytest.raises(HarnessError, match="not valid JSON"):
        load_report(tmp_path / "r.json")
    with pytest.raises(HarnessError, match="cannot read"):
        load_report(tmp_path / "missing")


# --- the shipped JSON Schema -----------------------------------------------------------------------
def test_shipped_schema_is_the_one_the_models_generate():
    assert SCHEMA_PATH == Path(__file__).resolve().parents[2] / "harness" / "results" / "report.schema.json"
    assert SCHEMA_PATH.read_text() == schema_text(), "run: python -m harness.results.schema"
    schema = json.loads(SCHEMA_PATH.read_text())
    assert schema == report_json_schema()
    assert set(schema["required"]) == {"schema_version", "name"}
    assert "goodput_bytes_per_s" in schema["$defs"]["Totals"]["properties"]


def test_shipped_node_metrics_schema_is_fresh_and_the_report_refers_to_it(capsys):
    assert NODE_METRICS_SCHEMA_PATH.parent == SCHEMA_PATH.parent
    assert json.loads(NODE_METRICS_SCHEMA_PATH.read_text()) == node_metrics_schema()
    assert schema_main(["--check"]) == 0 and capsys.readouterr().err == ""
    node = node_metrics_schema()
    assert {"goodput_bps", "payload_bytes_sent", "training_summary", "held_out"} <= set(node["properties"])
    nodes = report_json_schema()["$defs"]["Repeat"]["properties"]["nodes"]
    assert nodes["additionalProperties"] == {"$ref": node["$id"]}


def test_written_and_upgraded_reports_validate_against_the_shipped_schema(tmp_path):
    validator = report_validator()
    path = tmp_path / "report.json"
    writer = ReportWriter(path, HEADER)
    point = writer.start_point(0, {"compression": "none"}, {"num_workers": 2})
    writer.add_repeat(point, {"repeat": 0, "status": "ok", "totals": repeat_totals(_nodes(), _containers(1, 2)),
                              "nodes": _nodes(), "containers": _containers(1, 2)})
    writer.finish_point(point)
    writer.finish(complete=True)
    validator.validate(json.loads(path.read_text()))
    validator.validate(parse_report(buffers_report()).to_json_dict())
    broken = json.loads(path.read_text())
    broken["points"][0]["repeats"][0]["totals"]["batches_per_s"] = "fast"
    assert not validator.is_valid(broken)  # the schema does check the figures' types
    broken = json.loads(path.read_text())
    broken["points"][0]["repeats"][0]["nodes"]["worker-1"]["steps"] = "many"
    assert not validator.is_valid(broken)  # and the nodes' own metrics, through the node schema


# --- the text table --------------------------------------------------------------------------------
def test_render_table_aligns_columns_and_checks_rows():
    text = render_table("title", ["name", "n", "MB/s"], [["a", 1, "10.00"], ["longer", None, "2.50"]],
                        left_columns={"name"}, footer=["legend"])
    lines = text.splitlines()
    assert lines[0] == "title" and lines[-1] == "legend"
    assert lines[1].split() == ["name", "n", "MB/s"] and set(lines[2]) == {"─"}
    assert lines[3].startswith("a ") and lines[3].endswith("10.00") and lines[4].startswith("longer")
    assert lines[4].split() == ["longer", "-", "2.50"]  # None prints as -
    assert len({len(line) for line in lines[1:5]}) == 1 and not any(line.endswith(" ") for line in lines)
    with pytest.raises(ValueError, match="row 0 has 2 cells, the table has 3 columns"):
        render_table(None, ["a", "b", "c"], [[1, 2]])
