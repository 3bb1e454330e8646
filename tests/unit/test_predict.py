"""The predictor (`harness.analysis.predict`) on synthetic reports whose steps follow a known cause: a step
that is all link, a step that is all CPU on shared cores, the ring's latency terms; and its refusals."""

from __future__ import annotations

import json
import math

import pytest

from harness.analysis.predict import (
    TCP_PAYLOAD_SHARE,
    calibrate,
    error_summary,
    predict,
    report_measurements,
    ring_buckets,
    validate,
)
from harness.cli import main
from harness.errors import HarnessError

NUMEL = 250_000  # 1 MB of float32
RATE_BPS = 100e6


def _point(engine: dict, workers: int, step_s: float, *, rate_bps: float | None = RATE_BPS, delay_ms: float = 0.0,
           cpu_coordinator_s: float = 0.001, cpu_worker_s: float = 0.001, compute_s: float = 0.0,
           expected_bytes: float = 0.0) -> dict:
    nodes = {"coordinator": {"num_parameters": NUMEL, "step_cpu_s": {"median": cpu_coordinator_s}, "steps": 10}}
    for rank in range(1, workers + 1):
        nodes[f"worker-{rank}"] = {"step_cpu_s": {"median": cpu_worker_s}, "steps": 10, "compute_time_s": 10 * compute_s}
    profiles = {"all": {"rate_bps": rate_bps, "delay_ms": delay_ms}} if rate_bps else {}
    totals = {"step_time_median_s": step_s, "samples_per_s": workers * 32 / step_s, "compression_ratio": 1.0,
              "comm_expected_bytes_per_step": expected_bytes}
    return {"params": {"engine": engine["label"], "link": "test", "workers": workers}, "status": "ok",
            "config": {**{k: v for k, v in engine.items() if k != "label"}, "num_workers": workers, "batch_size": 32},
            "cluster": {"link": {"profiles": profiles}},
            "repeats": [{"repeat": 0, "status": "ok", "totals": totals, "nodes": nodes}]}


def _report(points: list[dict], cores: int = 2) -> dict:
    return {"machine_info": {"cpu_count_logical": cores}, "points": points}


CENTRAL = {"label": "central", "engine": "wiiide", "ps_shards": "1"}
SHARDED = {"label": "sharded", "engine": "wiiide", "ps_shards": "all"}
DDP = {"label": "ddp", "engine": "ddp"}
MODEL_S = NUMEL * 4 * 8 / (RATE_BPS * TCP_PAYLOAD_SHARE)  # one model through one shaped link


def test_a_link_bound_central_server_adds_one_model_per_worker_on_the_coordinators_link():
    """All link: at the central server the coordinator sends the parameters once per worker and the
    gradients come back over the workers' own links, so a step is (W + 1) models on a link plus a fixed
    cost. Measured at 2 and 4 workers, the step at 8 is that line's."""
    fixed_s = 0.02
    report = _report([_point(CENTRAL, w, fixed_s + (w + 1) * MODEL_S) for w in (2, 4, 8)])
    rows = validate(report_measurements(report), [2, 4])
    assert [r.workers for r in rows] == [8]
    assert rows[0].bound == "links" and rows[0].error == pytest.approx(0.0, abs=1e-9)


def test_a_cpu_bound_step_on_shared_cores_follows_the_cpu_of_every_node():
    """Unshaped links, 2 shared cores: the coordinator's CPU a step grows by 10 ms a worker, each worker
    takes 20 ms, so the nodes need 30 ms x W of CPU a step, 15 ms x W on 2 cores (plus a fixed 5 ms).
    With a machine per node the busiest node (the coordinator, 10 ms x W) decides instead."""
    points = [_point(CENTRAL, w, 0.005 + 0.015 * w, rate_bps=None, cpu_coordinator_s=0.010 * w, cpu_worker_s=0.020)
              for w in (2, 4)]
    cal = calibrate(report_measurements(_report(points)))
    shared = predict(cal, 16)
    assert shared.bound == "cores" and shared.step_s == pytest.approx(0.005 + 0.015 * 16, rel=1e-6)
    own = predict(cal, 16, machine_per_node=True)
    assert own.step_s == pytest.approx(0.005 + 0.010 * 16, rel=0.02)  # the links (8 Gbit/s) add < 2 %


def test_a_ring_whose_model_is_one_bucket_pays_its_link_time_and_its_cpu_one_after_the_other():
    """DDP with a 1 MB model (one 25 MiB bucket): the all-reduce starts when the backward is done, so a step
    on 2 shared cores is the CPU of every rank (10 ms the coordinator, 20 ms each worker, over 2 cores)
    plus the ring's bytes (2 (P-1)/P models a rank) plus 4 ms; the central server's link time hides its
    CPU. Calibrated at 2 and 4 workers, the step at 8 is the sum's, where a max would miss the CPU."""
    def ring_step(w):
        return 0.004 + 2 * w / (w + 1) * MODEL_S + (0.010 + 0.020 * w) / 2
    points = [_point(DDP, w, ring_step(w), cpu_coordinator_s=0.010, cpu_worker_s=0.020,
                     expected_bytes=2 * w * NUMEL * 4) for w in (2, 4, 8)]
    [row] = validate(report_measurements(_report(points)), [2, 4])
    assert row.workers == 8 and row.error == pytest.approx(0.0, abs=1e-6)
    assert row.step_s > 0.004 + max(row.links_s, row.cores_s) + 0.08  # the CPU's 85 ms are not hidden
    central = [_point(CENTRAL, w, 0.004 + (w + 1) * MODEL_S, cpu_coordinator_s=0.010, cpu_worker_s=0.020)
               for w in (2, 4, 8)]
    [row] = validate(report_measurements(_report(central)), [2, 4])
    assert row.error == pytest.approx(0.0, abs=1e-9)


@pytest.mark.parametrize("model_bytes, buckets", [(1.2e6, 1), (25 * 2**20, 1), (25 * 2**20 + 1, 2), (1e8, 4)])
def test_ring_buckets_follow_ddps_25_mib_bucket_cap(model_bytes, buckets):
    assert ring_buckets(model_bytes) == buckets


def test_the_ring_pays_two_latency_terms_per_node_and_the_parameter_server_two():
    """A ring all-reduce over P ranks takes 2 (P - 1) steps, each a link's delay; the parameter servers'
    push and pull take one delay each. 10 ms one way, 4 workers (P = 5): 80 ms against 20 ms."""
    ring = 2 * 4 / 5 * NUMEL * 4  # bytes one rank sends, as wiiide.engines.comm.estimate gives
    points = [_point(DDP, 4, 0.3, delay_ms=10.0, expected_bytes=5 * ring),
              _point(SHARDED, 4, 0.3, delay_ms=10.0)]
    by_engine = {m.engine: calibrate([m]) for m in report_measurements(_report(points))}
    assert predict(by_engine["ddp"], 4).latency_s == pytest.approx(0.080)
    assert predict(by_engine["sharded"], 4).latency_s == pytest.approx(0.020)
    assert predict(by_engine["ddp"], 9).latency_s == pytest.approx(0.180)


def test_sharded_and_ring_bytes_per_node_stay_below_two_models_however_many_workers():
    """Each node of a sharded server or a ring moves at most about two models a step (its pushes and
    its share of the pulls; reduce-scatter and all-gather), where the central server's coordinator
    moves one per worker: at 1,024 workers the links' time stays under 2 models' for both."""
    ring = 2 * 4 / 5 * NUMEL * 4
    points = [_point(SHARDED, 4, 0.2), _point(DDP, 4, 0.2, expected_bytes=5 * ring), _point(CENTRAL, 4, 0.5)]
    cals = {m.engine: calibrate([m]) for m in report_measurements(_report(points))}
    for engine in ("sharded", "ddp"):
        links = [predict(cals[engine], w).links_s for w in (4, 64, 1024)]
        assert links == sorted(links) and links[-1] < 2 * MODEL_S
    assert predict(cals["central"], 1024).links_s > 1000 * MODEL_S


def test_error_summary_is_the_geometric_mean_and_the_worst_of_the_absolute_errors():
    points = [_point(CENTRAL, 2, 0.1), _point(CENTRAL, 4, 0.2), _point(CENTRAL, 8, 0.5), _point(CENTRAL, 16, 1.0)]
    rows = validate(report_measurements(_report(points)), [2, 4])
    errors = [abs(r.error) for r in rows]
    summary = error_summary(rows)
    assert summary["count"] == 2 and summary["worst_abs_error"] == max(errors)
    assert summary["geomean_abs_error"] == pytest.approx(math.sqrt(errors[0] * errors[1]))


def test_refusals():
    cal = calibrate(report_measurements(_report([_point(CENTRAL, 2, 0.1)])))
    with pytest.raises(HarnessError, match="workers must be >= 1"):
        predict(cal, 0)
    with pytest.raises(HarnessError, match="nothing to calibrate"):
        calibrate([])
    mixed = report_measurements(_report([_point(CENTRAL, 2, 0.1), _point(SHARDED, 4, 0.1)]))
    with pytest.raises(HarnessError, match="one engine on one link"):
        calibrate(mixed)


def test_the_verb_prints_writes_json_and_refuses_bad_counts(tmp_path, capsys):
    path = tmp_path / "report.json"
    report = _report([_point(CENTRAL, w, 0.02 + (w + 1) * MODEL_S) for w in (2, 4)])
    for index, point in enumerate(report["points"]):
        point["index"] = index
    report.update({"schema_version": 1, "name": "synthetic", "spec": {}})
    path.write_text(json.dumps(report))
    assert main(["predict", str(path), "--workers", "x"]) == 2
    assert "--workers" in capsys.readouterr().err
    assert main(["predict", str(path), "--workers", "8,64"]) == 0
    written = json.loads((tmp_path / "predict.json").read_text())
    assert [r["workers"] for r in written["rows"]] == [8, 64]
    assert written["rows"][0]["step_s"] == pytest.approx(0.02 + 9 * MODEL_S, rel=1e-6)
