"""A run with ``tls: true`` on the local backend: the harness makes a CA and node certificates in the
run's folder, every connection is TLS 1.3 with the HMAC handshake inside, and the model trains."""

from __future__ import annotations

import os
import stat

from harness.results.report import (
    load_report_json as load_report,  # the report as its JSON object
)
from harness.spec.points import build_spec
from harness.sweep import run_sweep


def test_a_local_run_with_tls_trains(tmp_path):
    spec = build_spec({"name": "tls", "base": {"dataset": "digits", "num_workers": 2, "max_steps": 150,
                                               "duration_s": 60, "log_tier": "normal", "tls": True}}, "tls.yaml")
    report = load_report(run_sweep(spec, "local", tmp_path, progress=lambda line: None))
    rep = report["points"][0]["repeats"][0]
    assert rep["status"] == "ok", rep["error"]
    coord = rep["nodes"]["coordinator"]
    assert coord["tls"] == "TLSv1.3"
    assert coord["steps"] == 150 and sum(coord["batches_per_worker"].values()) == 300
    assert [e["event"] for e in coord["events"]].count("worker_joined") == 2
    assert not [e for e in coord["events"] if e["event"] == "connection_refused"]
    assert rep["totals"]["test_accuracy"] > 0.5
    keys = sorted(tmp_path.glob("**/tls/*/node.key"))
    assert [k.parent.name for k in keys] == ["coordinator", "worker-1", "worker-2"]
    assert all(stat.S_IMODE(os.stat(k).st_mode) == 0o600 for k in keys)


def test_bench_tls_tiny_local_run_writes_every_mode(tmp_path):
    import json

    from harness.bench.tls import run_bench

    path = run_bench("local", 64 * 1024, 1024 * 1024, 1, tmp_path, progress=lambda line: None, with_sslsocket=True)
    report = json.loads(path.read_text())
    assert sorted(t["mode"] for t in report["trials"]) == ["plain", "tls", "tls_sslsocket"]  # the third: SSLSocket
    assert all(t["frames"] == 16 and t["goodput_bytes_per_s"] > 0 and t["sink_cpu_s"] > 0 for t in report["trials"])
    assert set(report["summary"]) >= {"plain", "tls", "tls_over_plain_median_of_ratios", "meets_target",
                                      "tls_sslsocket", "tls_sslsocket_over_plain_median_of_ratios"}
    assert not list(tmp_path.glob(".bench-tls-*"))  # the certificates are gone with the scratch folder


def test_a_sharded_run_with_tls_wraps_every_shard_connection(tmp_path):
    spec = build_spec({"name": "tls-sharded", "base": {
        "dataset": "digits", "num_workers": 2, "max_steps": 40, "duration_s": 60, "log_tier": "normal",
        "tls": True, "ps_shards": "all", "partition_bytes": "8KiB"}}, "tls-sharded.yaml")
    report = load_report(run_sweep(spec, "local", tmp_path, progress=lambda line: None))
    rep = report["points"][0]["repeats"][0]
    assert rep["status"] == "ok", rep["error"]
    nodes = rep["nodes"]
    assert nodes["coordinator"]["tls"] == "TLSv1.3" and nodes["coordinator"]["steps"] == 40
    for name in ("coordinator", "worker-1", "worker-2"):  # each node's shard: every peer over TLS 1.3
        shard = nodes[name]["ps"]["shard"]
        assert shard["peer_tls"] == {"coordinator 0": "TLSv1.3", "worker 1": "TLSv1.3", "worker 2": "TLSv1.3"}, shard
        assert not [e for e in nodes[name]["events"] if "refused" in e["event"]]
    assert rep["totals"]["test_accuracy"] > 0.5
