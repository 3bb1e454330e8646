"""harness.results.frames and export: a report's tables in pandas, one row per repeat / node / sample /
evaluation, the swept params as columns, CSV and Parquet files that read back to the same frames."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import pandas as pd
import pytest

from harness.cli import main as cli_main
from harness.errors import HarnessError
from harness.results import TABLES, load_report
from harness.results.export import export_tables
from harness.results.frames import swept_params, to_dataframe
from harness.results.report import ReportWriter, parse_report
from harness.results.totals import repeat_totals
from tests.report_samples import REPO_ROOT, buffers_report, compression_report
from wiiide.metrics import NodeMetrics


def _real_nodes() -> dict[str, dict]:
    """A coordinator and two workers as NodeMetrics writes them (JSON and back)."""
    out = {}
    for name, role, rank in (("coordinator", "coordinator", 0), ("worker-1", "worker", 1), ("worker-2", "worker", 2)):
        m = NodeMetrics(role, name)
        m.rank = rank
        for step in range(3):
            m.record_worker_step(32, 1.0 / (step + 1), 0.01)
        if role == "coordinator":
            m.extra.update({"compression": "none", "test_accuracy": 0.9, "num_workers": 2,
                            "held_out": {"metric": "accuracy", "curve": []}})
        out[name] = json.loads(json.dumps(m.to_dict("ok")))
    return out


def _held_out(values: list[float]) -> dict:
    curve = [{"t_s": 0.5 * i, "step": 10 * i, "samples": 320 * i, "value": v, "eval_s": 0.01,
              "final": i == len(values) - 1} for i, v in enumerate(values)]
    return {"metric": "accuracy", "higher_is_better": True, "target": 0.8, "target_reached": True,
            "time_to_target_s": 0.5, "evaluations": len(curve), "curve": curve}


def _written_report(tmp_path) -> ReportWriter:
    """A two-point report as the sweep writes it, with real node metrics and held-out curves."""
    writer = ReportWriter(tmp_path / "tiny" / "report.json", {
        "name": "tiny", "backend": {"name": "local"}, "param_names": ["compression"],
        "spec": {"name": "tiny", "repeats": 2, "axes": {"compression": ["none", "zlib-1"]}}})
    for index, codec in enumerate(("none", "zlib-1")):
        config = {"num_workers": 2, "compression": codec, "seed": 0, "sndbuf_bytes": 2**20 * (index + 1)}
        point = writer.start_point(index, {"compression": codec}, config, cluster={"link": None, "cpus": None})
        for repeat in range(2):
            nodes = _real_nodes()
            writer.add_repeat(point, {"repeat": repeat, "status": "ok", "nodes": nodes,
                                      "totals": repeat_totals(nodes, {}),
                                      "held_out": _held_out([0.1, 0.85, 0.9 + 0.01 * repeat][:2 + repeat])})
        writer.finish_point(point)
    writer.finish(complete=True)
    return writer


def test_repeats_has_a_row_per_repeat_with_the_swept_params_and_totals():
    report = parse_report(buffers_report())  # schema version 1: upgraded on the way in
    df = to_dataframe(report, "repeats")
    assert len(df) == sum(len(p.repeats) for p in report.points) == 10
    assert list(df.columns[:5]) == ["point", "repeat", "buffer_bytes", "sndbuf_bytes", "rcvbuf_bytes"]
    assert list(df["buffer_bytes"].unique()) == ["1MiB", "4MiB", "8MiB", "16MiB"]
    assert df.loc[df.buffer_bytes == "4MiB", "sndbuf_bytes"].unique().tolist() == ["4MiB"]  # as the config has it
    assert "num_workers" not in df.columns  # the same in every point: not a swept column
    assert df["batches_per_s"].dtype == "Float64" and df["steps"].dtype == "Int64"
    by_point = df.groupby("buffer_bytes", sort=False)["batches_per_s"].median()
    assert by_point["1MiB"] == 300.0 and pd.isna(by_point["16MiB"])  # the failed point has no figure
    failed = df[df.status == "failed"]
    assert len(failed) == 2 and failed["error"].str.contains("timed out|ProtocolError").all()
    assert failed["batches_per_s"].isna().all()
    assert df.loc[0, "batches_per_worker.1"] == report.points[0].repeats[0].totals.batches_per_worker["1"] == 2250


def test_swept_columns_name_a_config_key_apart_from_an_axis_of_another_value():
    data = compression_report()
    data["param_names"] = ["compression", "engine"]
    for point in data["points"]:
        point["params"]["engine"] = "ps"  # an axis with the name of a totals figure
        point["config"]["engine"] = "wiiide"  # and of a config key with another value
        point["config"]["seed"] = point["index"]
        point["repeats"][0]["totals"]["engine"] = "wiiide"
    point = data["points"][1]
    point["config"]["engine"] = "ddp"
    report = parse_report(data)
    assert swept_params(report)[1] == {"compression": "zlib-1", "engine": "ps", "config.engine": "ddp", "seed": 1}
    df = to_dataframe(report, "repeats")
    assert "compression" in df and "config.compression" not in df  # the axis is the config key itself
    assert df["engine"].tolist() == ["ps"] * 4 and df["totals.engine"].tolist() == ["wiiide"] * 4
    assert df["config.engine"].tolist() == ["wiiide", "ddp", "wiiide", "wiiide"]


def test_nodes_has_a_row_per_node_per_repeat_with_role_rank_and_metrics(tmp_path):
    report = _written_report(tmp_path).report
    df = to_dataframe(report, "nodes")
    assert len(df) == 2 * 2 * 3
    assert list(df.columns[:7]) == ["point", "repeat", "compression", "sndbuf_bytes", "node", "role", "rank"]
    assert df.groupby(["point", "repeat"]).size().tolist() == [3, 3, 3, 3]
    coord = df[df.role == "coordinator"]
    assert coord["rank"].tolist() == [0] * 4 and coord["test_accuracy"].tolist() == [0.9] * 4
    assert coord["node.compression"].tolist() == ["none"] * 4  # the node's own field, apart from the axis
    assert df["step_time_s.count"].tolist() == [3] * 12 and df["steps"].dtype == "Int64"
    assert json.loads(df.loc[0, "events"]) == []  # lists are JSON text
    assert df["training_summary.total_steps"].tolist() == [3] * 12

    bad = copy.deepcopy(report)
    bad.points[1].repeats[0].nodes["worker-2"]["steps"] = "many"
    with pytest.raises(HarnessError, match="point 1 repeat 0 node worker-2: steps: .*integer.*many"):
        to_dataframe(bad, "nodes")


def test_stats_and_evals_have_a_row_per_sample_and_evaluation(tmp_path):
    report = parse_report(buffers_report())
    df = to_dataframe(report, "stats")
    samples = sum(len(c.samples) for p in report.points for r in p.repeats for c in r.containers.values())
    assert len(df) == samples == 10 * 5 * 12  # 10 repeats, a coordinator and 4 workers, 12 samples
    assert list(df.columns[:8]) == ["point", "repeat", "buffer_bytes", "sndbuf_bytes", "rcvbuf_bytes",
                                    "container", "role", "kind"]
    coord = df[(df.point == 0) & (df.repeat == 0) & (df.container == "wiiide_coordinator_1")]
    assert coord["t_s"].is_monotonic_increasing and coord["memory_bytes"].iloc[0] == 290_000_000
    assert df["net_rx_bytes"].dtype == "Int64"

    written = _written_report(tmp_path).report
    evals = to_dataframe(written, "evals")
    assert len(evals) == 2 + 3 + 2 + 3  # every repeat's curve, one row per evaluation
    first = evals[(evals.point == 0) & (evals.repeat == 1)]
    assert first["value"].tolist() == [0.1, 0.85, 0.91] and first["final"].tolist() == [False, False, True]
    assert (first["metric"] == "accuracy").all() and (first["target"] == 0.8).all()
    assert to_dataframe(parse_report(buffers_report()), "evals").empty  # no repeat evaluated


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_exported_tables_read_back_to_the_same_frames(tmp_path, fmt):
    report = _written_report(tmp_path).report
    report.points.extend(parse_report(buffers_report()).points[3:])  # a failed repeat too: <NA> figures
    report.points[-1].index = 2
    paths = export_tables(report, tmp_path / "out", fmt)
    assert [p.name for p in paths] == [f"{t}.{fmt}" for t in TABLES]
    for table, path in zip(TABLES, paths):
        frame = to_dataframe(report, table)
        if fmt == "parquet":
            back = pd.read_parquet(path)
        else:  # CSV has no types: read with the frame's
            back = pd.read_csv(path, dtype=frame.dtypes.to_dict())
        pd.testing.assert_frame_equal(back, frame)
        assert len(back) > 0


def test_export_cli_writes_next_to_the_report_and_fails_in_one_line(tmp_path, capsys):
    path = tmp_path / "old" / "report.json"
    path.parent.mkdir()
    path.write_text(json.dumps(buffers_report()))  # schema version 1
    assert cli_main(["export", str(path.parent), "--table", "repeats", "--table", "stats"]) == 0
    out = capsys.readouterr().out.split()
    assert out == [str(path.parent / "repeats.csv"), str(path.parent / "stats.csv")]
    assert len(pd.read_csv(out[0])) == 10
    assert cli_main(["export", str(path), "--format", "parquet", "--out", str(tmp_path / "pq")]) == 0
    assert sorted(p.name for p in (tmp_path / "pq").iterdir()) == sorted(f"{t}.parquet" for t in TABLES)

    (tmp_path / "notes.json").write_text('{"name": "not a report"}')
    for bad, message in ((tmp_path / "missing", "cannot read"), (tmp_path / "notes.json", "not a WIIIIIDE sweep report")):
        assert cli_main(["export", str(bad)]) == 1
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1 and "Traceback" not in err
    with pytest.raises(HarnessError, match="cannot read"):
        load_report(tmp_path / "missing")
    with pytest.raises(HarnessError, match="no table 'points'"):
        to_dataframe(load_report(path), "points")
    with pytest.raises(HarnessError, match="format 'xlsx'"):
        export_tables(load_report(path), tmp_path, "xlsx")


def test_an_empty_report_has_empty_tables_with_their_key_columns():
    report = parse_report({"schema_version": 2, "name": "empty", "points": []})
    for table in TABLES:
        df = to_dataframe(report, table)
        assert df.empty and list(df.columns[:2]) == ["point", "repeat"]


def test_declared_columns_are_in_every_report_whatever_its_nodes_wrote():
    df = to_dataframe(parse_report(buffers_report()), "nodes")  # the sample's nodes: role, status, sockets only
    assert len(df) == 8 and df["step_time_s.median"].isna().all() and df["goodput_bps"].isna().all()
    assert "step_time_s" not in df and df["step_time_s.median"].dtype == "Float64"
    assert json.loads(df.loc[0, "socket_options"])[0]["sndbuf_bytes"] == 2**21


def test_the_example_of_docs_results_runs(tmp_path):
    """The notebook example in docs/results.md runs, as a script, on the sample report."""
    (tmp_path / "report.json").write_text(json.dumps(buffers_report()))
    text = (REPO_ROOT / "docs" / "results.md").read_text()
    code = text.split("## Example: a notebook")[1].split("```python\n")[1].split("```")[0]
    assert '"results/seed-buffers-20261121T150827Z"' in code
    script = "import matplotlib\nmatplotlib.use('Agg')\n" + code.replace(
        '"results/seed-buffers-20261121T150827Z"', repr(str(tmp_path))) + "\nprint(len(ok), sorted(set(workers.role)))\n"
    done = subprocess.run([sys.executable, "-"], input=script, capture_output=True, text=True, timeout=120,
                          cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[-2] == "8 []"  # 8 ok repeats; the sample's nodes are coordinators only
