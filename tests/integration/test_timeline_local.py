"""A small local sweep with trace_steps: every node keeps the spans of the traced steps only, and the
timeline verb writes them as a Chrome trace (Trace Event Format) that the HTML page links: per node its
compute, the pushes and pulls of every partition with their bytes, the shards' updates, DDP's collectives."""

from __future__ import annotations

import json

import pytest

from harness.cli import main as cli_main
from harness.present.html import write_html
from harness.spec.points import build_spec
from harness.sweep import run_sweep

WARMUP, TRACED = 3, 4


@pytest.fixture(scope="module")
def report_path(tmp_path_factory):
    spec = build_spec({
        "name": "timeline", "repeats": 1,
        "base": {"dataset": "digits", "num_workers": 2, "max_steps": 12, "duration_s": 60, "log_tier": "silent",
                 "connect_timeout_s": 60, "warmup_steps": WARMUP, "trace_steps": TRACED},
        "axes": {"engine": [{"label": "central", "engine": "wiiide", "ps_shards": "1"},
                            {"label": "sharded", "engine": "wiiide", "ps_shards": "all"},
                            "ddp"]},
    }, "timeline.yaml")
    return run_sweep(spec, "local", tmp_path_factory.mktemp("results"), progress=lambda line: None)


def _trace(report_path, point: int) -> dict:
    out = report_path.parent / f"t{point}.json"
    assert cli_main(["timeline", str(report_path), "--point", str(point), "--out", str(out)]) == 0
    return json.loads(out.read_text())


def _spans(trace: dict) -> dict[str, list[dict]]:
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    by_node: dict[str, list[dict]] = {name: [] for name in names.values()}
    for e in trace["traceEvents"]:
        if e["ph"] == "X":
            assert e["dur"] >= 0 and e["ts"] >= 0 and isinstance(e["tid"], int)
            by_node[names[e["pid"]]].append(e)
    return by_node


def test_only_the_traced_steps_are_kept_on_every_node(report_path):
    for point in range(3):
        for node, spans in _spans(_trace(report_path, point)).items():
            assert spans, node
            assert {e["args"]["step"] for e in spans} <= set(range(WARMUP, WARMUP + TRACED)), (point, node)


def test_a_sharded_worker_shows_compute_pushes_pulls_and_its_shards_updates(report_path):
    by_node = _spans(_trace(report_path, 1))
    assert sorted(by_node) == ["coordinator", "worker-1", "worker-2"]
    worker = by_node["worker-1"]
    kinds = {(e["cat"], e["name"]) for e in worker}
    assert ("compute", "compute") in kinds and ("update", "update") in kinds
    pushes = [e for e in worker if e["cat"] == "send" and e["name"].endswith("ps_dense")]
    pulls = [e for e in worker if e["cat"] == "receive" and e["name"].endswith("ps_dense")]
    assert pushes and pulls and all(e["args"]["wire_bytes"] > 0 for e in pushes + pulls)
    # the pushes of a step leave from the sender threads, not the training loop's track
    assert len({e["tid"] for e in pushes}) >= 2
    steps = [e for e in by_node["coordinator"] if e["cat"] == "step"]
    assert sorted(e["args"]["step"] for e in steps) == list(range(WARMUP, WARMUP + TRACED))


def test_the_central_server_and_ddp_show_their_exchanges(report_path):
    central = _spans(_trace(report_path, 0))
    assert any(e["name"] == "send params" for e in central["coordinator"])
    assert any(e["name"] == "receive gradients" for e in central["coordinator"])
    assert any(e["name"] == "update" for e in central["coordinator"])
    assert any(e["name"] == "send gradients" for e in central["worker-1"])
    ddp = _spans(_trace(report_path, 2))
    assert all(any(e["cat"] == "comm" for e in spans) for spans in ddp.values())


def test_the_page_links_each_traced_repeats_timeline(report_path):
    page = write_html([report_path]).read_text()
    for point in range(3):
        name = f"timeline-p{point}-r0.json"
        assert f'href="{name}"' in page and (report_path.parent / name).is_file()


def test_a_report_without_spans_is_refused_with_the_knob_to_set(tmp_path, report_path):
    data = json.loads(report_path.read_text())
    for point in data["points"]:
        for rep in point["repeats"]:
            for node in rep["nodes"].values():
                node.pop("trace", None)
    bare = tmp_path / "report.json"
    bare.write_text(json.dumps(data))
    assert cli_main(["timeline", str(bare)]) == 2
