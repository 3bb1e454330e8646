"""The embedding model on the local backend: the parameter server with sparse rows moves fewer bytes
than the same run dense, trains the same way, and records the expected bytes per step."""

from __future__ import annotations

import pytest

from harness.results.report import load_report_json as load_report
from harness.spec.points import build_spec
from harness.sweep import run_sweep


def test_sparse_embedding_moves_fewer_bytes_than_dense(tmp_path):
    spec = build_spec({
        "name": "workloads-tiny", "repeats": 1,
        "base": {"model": "embedding", "embedding_rows": 100_000, "embedding_samples": 2000, "num_workers": 2,
                 "batch_size": 8, "max_steps": 10, "duration_s": 120, "warmup_steps": 2, "log_tier": "silent",
                 "connect_timeout_s": 60, "ps_shards": "1"},  # the central server (sharded: test_sparse_rows_sharded)
        "axes": {"sparse_embedding": [False, True]},
    }, "workloads-tiny.yaml")
    report = load_report(run_sweep(spec, "local", tmp_path, progress=lambda line: None))
    by = {p["params"]["sparse_embedding"]: p for p in report["points"]}
    for point in by.values():
        assert point["status"] == "ok", point["error"]
    dense, sparse = (by[k]["repeats"][0]["nodes"]["coordinator"] for k in (False, True))
    moved = {k: n["wire_bytes_sent"] + n["wire_bytes_received"] for k, n in (("dense", dense), ("sparse", sparse))}
    assert moved["sparse"] * 10 < moved["dense"]
    assert sparse["loss_final"] == pytest.approx(dense["loss_final"], rel=1e-5)
    # the expected bytes a step against what the runs moved: the dense server every parameter both ways, the
    # sparse one the same after each worker's first, whole pull (frame heads and the handshakes on top)
    expected = sparse["comm"]["expected"]
    assert moved["dense"] / dense["steps"] == pytest.approx(expected["dense_total_bytes"], rel=0.05)
    row_bytes = moved["sparse"] - 2 * expected["param_bytes"]
    assert row_bytes / sparse["steps"] == pytest.approx(expected["total_bytes"], rel=0.15)
