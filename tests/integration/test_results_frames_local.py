"""A real small sweep on the local backend read as pandas tables and exported: one row per repeat,
node, stats sample and held-out evaluation; the nodes' files match their published schema."""

from __future__ import annotations

import json

import jsonschema
import pandas as pd
import pytest

from harness.cli import main as cli_main
from harness.results import TABLES, frames, load_report
from harness.results.schema import NODE_METRICS_SCHEMA_PATH
from harness.spec.points import build_spec
from harness.sweep import run_sweep


@pytest.fixture(scope="module")
def report_dir(tmp_path_factory):
    spec = build_spec({
        "name": "frames", "repeats": 1,
        "base": {"dataset": "digits", "num_workers": 2, "max_steps": 40, "duration_s": 60, "log_tier": "silent",
                 "connect_timeout_s": 30, "eval_every_s": 0.2},
        "axes": {"compression": ["none", "zlib-1"]},
    }, "frames.yaml")
    return run_sweep(spec, "local", tmp_path_factory.mktemp("results"), progress=lambda line: None).parent


def test_a_local_sweep_reads_as_one_row_per_repeat_node_sample_and_evaluation(report_dir):
    report = load_report(report_dir)
    repeats = frames.repeats(report)
    assert len(repeats) == 2 and repeats["compression"].tolist() == ["none", "zlib-1"]
    assert (repeats["status"] == "ok").all() and (repeats["batches_per_s"] > 0).all()
    assert repeats["steps"].tolist() == [p.repeats[0].totals.steps for p in report.points]

    nodes = frames.nodes(report)
    assert len(nodes) == 2 * 3  # a coordinator and two workers per repeat
    assert sorted(nodes.loc[nodes.point == 0, "node"]) == ["coordinator", "worker-1", "worker-2"]
    assert nodes.loc[nodes.role == "worker", "rank"].tolist() == [1, 2, 1, 2]
    assert (nodes["status"] == "ok").all() and (nodes["payload_bytes_sent"] > 0).all()

    stats = frames.stats(report)
    samples = sum(len(c.samples) for p in report.points for c in p.repeats[0].containers.values())
    assert len(stats) == samples > 0 and set(stats["kind"]) == {"process"}

    evals = frames.evals(report)
    curves = [p.repeats[0].held_out.curve for p in report.points]
    assert len(evals) == sum(len(c) for c in curves) >= 2
    assert evals["value"].between(0, 1).all() and (evals["metric"] == "accuracy").all()
    assert evals.groupby("point")["final"].sum().tolist() == [1, 1]  # each curve ends with the final parameters


def test_the_nodes_files_match_the_published_node_schema(report_dir):
    validator = jsonschema.Draft202012Validator(json.loads(NODE_METRICS_SCHEMA_PATH.read_text()))
    report = load_report(report_dir)
    for point in report.points:
        for name, node in point.repeats[0].nodes.items():
            errors = [e.message for e in validator.iter_errors(node)]
            assert errors == [], f"{name}: {errors}"


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_export_writes_every_table_that_reads_back_the_same(report_dir, tmp_path, capsys, fmt):
    assert cli_main(["export", str(report_dir), "--format", fmt, "--out", str(tmp_path)]) == 0
    paths = capsys.readouterr().out.split()
    assert paths == [str(tmp_path / f"{t}.{fmt}") for t in TABLES]
    report = load_report(report_dir)
    for table, path in zip(TABLES, paths):
        frame = frames.to_dataframe(report, table)
        back = pd.read_parquet(path) if fmt == "parquet" else pd.read_csv(path, dtype=frame.dtypes.to_dict())
        pd.testing.assert_frame_equal(back, frame)
