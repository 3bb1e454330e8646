"""`python -m harness bench-wire` at a tiny size on the local backend: the JSON's structure, not timings."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys

from harness import REPO_ROOT
from harness.bench.wire import format_table, run_bench, summarize


def test_bench_wire_tiny_local_run_writes_the_report(tmp_path):
    path = run_bench("local", sizes=[64 * 1024, 1024 * 1024], frame_codecs=["none", "zstd-1", "int8"],
                     table_codecs=["none", "zstd-1", "shuffle-lz4", "topk-0.01"], link_rates=[100e6, 0],
                     link_policies=["fixed:none", "fixed:zstd-1", "seed", "network-aware"], repeats=2,
                     bytes_per_trial=2 * 1024 * 1024, link_messages=3, table_threads=(1, 2), small=True,
                     results_dir=tmp_path, progress=lambda line: None)
    assert path.parent == tmp_path and path.name.startswith("bench-wire-") and path.suffix == ".json"
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no scratch folder left
    report = json.loads(path.read_text())
    assert report["name"] == "bench-wire" and report["schema_version"] == 1
    assert report["backend"]["name"] == "local"
    assert {"cpu_model", "memory_total_bytes", "python_version"} <= set(report["machine_info"])
    assert {"id", "dirty"} <= set(report["commit_info"])
    assert report["plan"]["sizes"] == [65536, 1048576]

    frames = report["frames"]
    assert [r["size_bytes"] for r in frames] == [65536, 1048576]
    for r in frames:
        assert len(r["raw_Bps"]) == 2 and all(v > 0 for v in r["raw_Bps"])
        assert set(r["frames"]) == {"none", "zstd-1", "int8"}
        for entry in r["frames"].values():
            assert len(entry["Bps"]) == 2 and entry["Bps_median"] > 0
            assert len(entry["vs_raw_per_repeat"]) == 2
            assert entry["vs_raw_per_repeat"] == [f / raw for f, raw in zip(entry["Bps"], r["raw_Bps"])]
            assert entry["vs_raw"] == statistics.median(entry["vs_raw_per_repeat"])
        assert r["frames"]["int8"]["wire_nbytes"] < r["frames"]["none"]["wire_nbytes"]

    codecs = report["codecs"]
    assert {c["gradient"] for c in codecs} == {"digits-mlp", "synthetic-mlp"}
    rows = {(c["gradient"], c["codec"], c["threads"]): c for c in codecs}
    assert ("digits-mlp", "zstd-1", 2) in rows and ("digits-mlp", "topk-0.01", 2) not in rows  # lossy: 1 thread
    assert rows[("digits-mlp", "none", 1)]["ratio"] == 1.0
    assert rows[("digits-mlp", "topk-0.01", 1)]["ratio"] > 40
    assert rows[("digits-mlp", "zstd-1", 1)]["raw_nbytes"] == 1_204_264  # 64-512-512-10
    assert all(len(c["decode_MBps"]) >= 1 for c in codecs)

    links = report["links"]
    assert len(links) == 2 * 4
    for row in links:
        assert len(row["message_s"]) == 3 and sum(row["codecs_used"].values()) == 3
    assert {r["rate_bps"] for r in links} == {100e6, None}

    summary = report["summary"]
    assert summary == summarize(report)
    assert set(summary["uncompressed_frames_vs_raw_from_1MiB"]) == {"1048576"}
    assert set(summary["links"]) == {"100000000", "unpaced"}
    assert {"best_fixed", "network_aware_vs_best_fixed", "beats_seed"} <= set(summary["links"]["unpaced"])
    table = format_table(report)
    assert "frames:" in table and "links:" in table and "target:" in table


def test_bench_wire_cli_refuses_bad_options_before_running():
    out = subprocess.run([sys.executable, "-m", "harness", "bench-wire", "--sizes", "64 furlongs"], cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1].startswith("error: bench-wire: --sizes")
