"""`python -m harness bench-wire` at a tiny size on the local backend: what the JSON holds, not timings."""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys

import numpy as np
import pytest

from harness import REPO_ROOT
from harness.bench.wire.codec_table import codec_table
from harness.bench.wire.plan import WirePlan
from harness.bench.wire.run import SCHEMA_VERSION, run_bench
from harness.bench.wire.table import format_report

KIB, MIB = 1024, 1024 * 1024
# float32 parameters of the MLPs, counted from their layer widths (weights + biases) x 4 bytes
DIGITS_MLP_BYTES = 4 * (64 * 512 + 512 + 512 * 512 + 512 + 512 * 10 + 10)  # 1,204,264
SMALL_SYNTHETIC_MLP_BYTES = 4 * (256 * 1024 + 1024 + 1024 * 1024 + 1024 + 1024 * 10 + 10)  # 5,292,072
INT8_BLOCK_OVERHEAD = 1.05  # int8: one byte per element plus a scale per block (ratio 3.938 in docs/benchmarks.md)


def _keys(value) -> set[str]:
    if isinstance(value, dict):
        return set(value) | {k for v in value.values() for k in _keys(v)}
    if isinstance(value, list):
        return {k for v in value for k in _keys(v)}
    return set()


def test_bench_wire_tiny_local_run_writes_the_report(tmp_path):
    plan = WirePlan(sizes_bytes=(64 * KIB, MIB), frame_codecs=("none", "zstd-1", "int8"),
                    table_codecs=("none", "zstd-1", "fp16", "topk-0.01"), link_rates_bps=(100e6, 0),
                    link_policies=("fixed:none", "fixed:zstd-1", "seed", "network-aware"), repeats=2,
                    bytes_per_trial=2 * MIB, link_messages=3, table_threads=(1, 2), small=True)
    path = run_bench(plan, "local", results_dir=tmp_path, progress=lambda line: None)
    assert path.parent == tmp_path and path.name.startswith("bench-wire-") and path.suffix == ".json"
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no scratch folder left
    report = json.loads(path.read_text())
    assert report["name"] == "bench-wire" and report["schema_version"] == SCHEMA_VERSION == 2
    assert report["backend"]["name"] == "local"
    assert {"cpu_model", "memory_total_bytes", "python_version"} <= set(report["machine_info"])
    assert {"id", "dirty"} <= set(report["commit_info"])
    assert report["plan"]["sizes_bytes"] == [65536, 1048576] and report["plan"]["link_rates_bps"] == [1e8, 0]
    assert WirePlan.from_dict(report["plan"]) == plan
    # byte rates say bytes per second, bit rates bps: none of schema 1's spellings is left
    keys = _keys(report)
    assert not {k for k in keys if "Bps" in k or "MBps" in k}
    assert {"raw_bytes_per_s", "bytes_per_s", "encode_bytes_per_s", "goodput_bytes_per_s", "rate_bps"} <= keys

    assert report["gradients"] == {
        "digits-mlp": {"nbytes": DIGITS_MLP_BYTES, "elements": DIGITS_MLP_BYTES // 4},
        "synthetic-mlp": {"nbytes": SMALL_SYNTHETIC_MLP_BYTES, "elements": SMALL_SYNTHETIC_MLP_BYTES // 4}}

    frames = report["frames"]
    assert [r["size_bytes"] for r in frames] == [64 * KIB, MIB]
    assert [r["count_per_trial"] for r in frames] == [32, 2]  # 2 MiB per trial / size, at least 2
    for r in frames:
        size = r["size_bytes"]
        assert len(r["raw_bytes_per_s"]) == 2 and min(r["raw_bytes_per_s"]) > 0
        # every raw loop was measured; the reference is the fastest by median, with its own figures
        assert set(r["raw_variants"]) == {"sendall/whole", "sendmsg/whole", "sendall/chunk", "sendall/scratch",
                                          "sendmsg-split/whole", "sendall/framed"}
        medians = {k: v["bytes_per_s_median"] for k, v in r["raw_variants"].items()}
        assert r["raw_variant"] == max(medians, key=medians.get)
        assert r["raw_bytes_per_s"] == r["raw_variants"][r["raw_variant"]]["bytes_per_s"]
        if shutil.which("iperf3"):  # the physical reference, from iperf3's JSON
            assert len(r["iperf3"]["bytes_per_s"]) == 2 and r["iperf3"]["version"].startswith("iperf 3")
            assert r["frames"]["none"]["vs_iperf3"] == pytest.approx(statistics.median(
                f / i for f, i in zip(r["frames"]["none"]["bytes_per_s"], r["iperf3"]["bytes_per_s"])))
        else:
            assert "iperf3 is not installed" in r["iperf3"]["unavailable"]
        # the codecs asked for, and the uncompressed frame encoded once and sent again (none/prebuilt)
        assert set(r["frames"]) == {"none", "zstd-1", "int8", "none/prebuilt"}
        for entry in r["frames"].values():
            assert len(entry["bytes_per_s"]) == len(entry["vs_raw_per_repeat"]) == len(entry["sink_decode_s"]) == 2
            assert min(entry["vs_raw_per_repeat"]) <= entry["vs_raw"] <= max(entry["vs_raw_per_repeat"])
            assert min(entry["bytes_per_s"]) <= entry["bytes_per_s_median"] <= max(entry["bytes_per_s"])
        # each process's CPU seconds per second of every trial: both ends did work in each one
        for entry in [*r["frames"].values(), *r["raw_variants"].values()]:
            assert len(entry["source_cpu_per_s"]) == len(entry["sink_cpu_per_s"]) == 2
            assert min(entry["source_cpu_per_s"]) > 0 and min(entry["sink_cpu_per_s"]) > 0
        # an uncompressed frame is the payload plus a 16-byte prefix and a JSON header of a few hundred bytes
        assert size < r["frames"]["none"]["wire_nbytes"] < size + 4 * KIB
        assert r["frames"]["none/prebuilt"]["wire_nbytes"] == r["frames"]["none"]["wire_nbytes"]
        # int8: one byte per float32 element plus per-block scales, and the same header
        assert size // 4 < r["frames"]["int8"]["wire_nbytes"] < size // 4 * INT8_BLOCK_OVERHEAD + 4 * KIB
        # zstd-1 is lossless on float32 gradients: ratio about 1.09 (docs/benchmarks.md), never below raw by much
        assert 0.8 * size < r["frames"]["zstd-1"]["wire_nbytes"] < size + 4 * KIB

    rows = {(c["gradient"], c["codec"], c["threads"]): c for c in report["codecs"]}
    assert {g for g, _, _ in rows} == {"digits-mlp", "synthetic-mlp"}
    assert ("digits-mlp", "zstd-1", 2) in rows and ("digits-mlp", "topk-0.01", 2) not in rows  # lossy: 1 thread
    assert ("digits-mlp", "fp16", 2) not in rows
    assert rows[("digits-mlp", "none", 1)]["ratio"] == 1.0
    assert rows[("digits-mlp", "fp16", 1)]["ratio"] == 2.0  # 4 bytes -> 2 per element
    assert 49 < rows[("digits-mlp", "topk-0.01", 1)]["ratio"] <= 50.5  # 1 % kept, value + index: 8 bytes each
    assert rows[("digits-mlp", "zstd-1", 1)]["raw_nbytes"] == DIGITS_MLP_BYTES
    assert rows[("synthetic-mlp", "zstd-1", 1)]["raw_nbytes"] == SMALL_SYNTHETIC_MLP_BYTES
    assert all(1 <= len(c["decode_bytes_per_s"]) <= 2 for c in report["codecs"])

    links = report["links"]
    assert [(r["rate_bps"], r["policy"]) for r in links] == [
        (rate, p) for rate in (1e8, None) for p in ("fixed:none", "fixed:zstd-1", "seed", "network-aware")]
    for row in links:
        assert len(row["message_s"]) == 3 and sum(row["codecs_used"].values()) == 3
    by_policy = {(r["rate_bps"], r["policy"]): r for r in links}
    assert by_policy[(1e8, "fixed:none")]["codecs_used"] == {"none": 3}
    assert by_policy[(None, "fixed:zstd-1")]["codecs_used"] == {"zstd-1": 3}
    # seed: gradients over 1 MiB at zlib-1 (the digits gradient is 1.2 MB)
    assert by_policy[(None, "seed")]["codecs_used"] == {"zlib-1": 3}

    summary = report["summary"]
    assert set(summary["uncompressed_frames_vs_raw_from_1MiB"]) == {"1048576"}
    assert set(summary["links"]) == {"100000000", "unpaced"}
    assert summary["links"]["unpaced"]["best_fixed"] in {"fixed:none", "fixed:zstd-1"}
    table = format_report(report)
    assert "frames:" in table and "links:" in table and "target:" in table and "64KiB" in table
    assert "CPU seconds per second" in table and "none/prebuilt" in table


def test_codec_table_on_known_payloads():
    """All-zeros compresses to a tiny fraction, random bits do not, and ``none`` moves the bytes as they are."""
    n = 256 * KIB
    zeros = np.zeros(n // 4, dtype=np.float32)
    random_bits = np.frombuffer(np.random.default_rng(0).bytes(n), dtype=np.float32)
    rows = {(r["gradient"], r["codec"]): r
            for r in codec_table({"zeros": zeros, "random": random_bits}, ["none", "zstd-1", "lz4"], [1], 2,
                                 lambda line: None)}
    assert set(rows) == {(g, c) for g in ("zeros", "random") for c in ("none", "zstd-1", "lz4")}
    for r in rows.values():
        assert r["raw_nbytes"] == n and r["threads"] == 1 and r["lossless"] is True
        assert len(r["decode_bytes_per_s"]) == len(r["encode_bytes_per_s"]) == 2
    assert rows[("zeros", "none")]["ratio"] == rows[("random", "none")]["ratio"] == 1.0
    assert rows[("zeros", "zstd-1")]["ratio"] > 100 and rows[("zeros", "lz4")]["ratio"] > 100
    assert rows[("random", "zstd-1")]["ratio"] < 1.01 and rows[("random", "lz4")]["ratio"] < 1.01


def test_bench_wire_cli_refuses_bad_options_before_running():
    out = subprocess.run([sys.executable, "-m", "harness", "bench-wire", "--sizes", "64 furlongs"], cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1].startswith("error: bench-wire: --sizes: '64 furlongs' is not a size")


def test_peer_entry_point_answers_without_a_role():
    out = subprocess.run([sys.executable, "-m", "harness.bench.wire", "peer"], cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--role" in out.stderr
