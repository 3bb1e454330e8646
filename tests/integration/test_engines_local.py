"""Engines side by side on the local backend: WIIIIIDE, DDP and FSDP on the same tiny point (2 workers,
30 steps on digits), plus DDP and FSDP with their options; metrics files, Training Summary, communication
profile, held-out accuracy, the same training trajectory, and `harness compare` on the report."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from harness.results.report import (
    load_report_json as load_report,  # the report as its JSON object
)
from harness.spec.points import build_spec
from harness.sweep import run_sweep

REPO_ROOT = Path(__file__).resolve().parents[2]
STEPS = 30
VARIANTS = ["wiiide", "ddp", "fsdp",
            {"label": "ddp-fp16-accum2", "engine": "ddp", "ddp_comm_hook": "fp16", "grad_accum_steps": 2,
             "profile": True},
            {"label": "fsdp-gradop-bf16", "engine": "fsdp", "fsdp_reshard_after_forward": False,
             "mixed_precision": "bf16"}]


@pytest.fixture(scope="module")
def engines_report(tmp_path_factory):
    spec = build_spec({
        "name": "engines-tiny", "repeats": 1,
        "base": {"dataset": "digits", "num_workers": 2, "max_steps": STEPS, "duration_s": 120, "warmup_steps": 10,
                 "log_tier": "silent", "connect_timeout_s": 60},
        "axes": {"engine": VARIANTS},
    }, "engines-tiny.yaml")
    path = run_sweep(spec, "local", tmp_path_factory.mktemp("results"), progress=lambda line: None)
    report = load_report(path)
    return path, report, {p["params"]["engine"]: p["repeats"][0] for p in report["points"]}


def test_every_engine_runs_and_writes_every_nodes_metrics(engines_report):
    _, report, by_engine = engines_report
    assert set(by_engine) == {"wiiide", "ddp", "fsdp", "ddp-fp16-accum2", "fsdp-gradop-bf16"}
    for point in report["points"]:
        assert point["status"] == "ok", point["error"]
    for label, rep in by_engine.items():
        assert set(rep["nodes"]) == {"coordinator", "worker-1", "worker-2"}, label
        ranks = sorted(n["rank"] for n in rep["nodes"].values())
        assert ranks == [0, 1, 2], label
        for node in rep["nodes"].values():
            assert node["status"] == "ok" and node["steps"] == STEPS, label


def test_training_summary_and_accuracy(engines_report):
    _, _, by_engine = engines_report
    for label, rep in by_engine.items():
        for name, node in rep["nodes"].items():
            s = node["training_summary"]
            assert (s["num_steps"], s["warmup_steps"], s["total_steps"]) == (STEPS - 10, 10, STEPS), (label, name)
            assert s["min_step_time_s"] <= s["avg_step_time_s"] <= s["max_step_time_s"]
            assert s["peak_rss_bytes"] >= s["avg_rss_bytes"] > 0
            assert s["final_loss"] < s["avg_loss"] or s["final_loss"] < 2.3  # learning, below ln(10)
        coord = rep["nodes"]["coordinator"]["training_summary"]
        assert coord["samples_per_step"] == 64  # the global batch: 2 workers x 32, on every engine
        totals = rep["totals"]
        assert totals["throughput_samples_per_s"] == pytest.approx(64 / coord["avg_step_time_s"])
        assert totals["test_accuracy"] > 0.5, label  # 10 classes: chance is 0.1


def test_same_data_same_trajectory(engines_report):
    """Same model, data, global batch, seed and optimizer: DDP and FSDP follow WIIIIIDE's losses."""
    _, _, by_engine = engines_report
    ref = by_engine["wiiide"]["nodes"]["coordinator"]
    for label in ("ddp", "fsdp"):
        node = by_engine[label]["nodes"]["coordinator"]
        assert node["loss_final"] == pytest.approx(ref["loss_final"], rel=1e-4), label
        assert node["loss_avg"] == pytest.approx(ref["loss_avg"], rel=1e-4), label
        assert node["test_accuracy"] == pytest.approx(ref["test_accuracy"], abs=0.006), label
    # the options change the arithmetic a little (fp16 gradients, bf16 parameters), not the learning
    for label in ("ddp-fp16-accum2", "fsdp-gradop-bf16"):
        node = by_engine[label]["nodes"]["coordinator"]
        assert node["loss_final"] == pytest.approx(ref["loss_final"], rel=0.05), label


def test_options_are_applied(engines_report):
    _, _, by_engine = engines_report
    accum = by_engine["ddp-fp16-accum2"]["nodes"]
    assert accum["coordinator"]["micro_batches"] == [11, 11]  # 22 samples of rank 0 in 2 micro-batches
    assert accum["worker-1"]["micro_batches"] == [11, 10]
    assert accum["coordinator"]["comm"]["expected"]["scheme"] == "ring-all-reduce-fp16"
    gradop = by_engine["fsdp-gradop-bf16"]["nodes"]["coordinator"]
    assert gradop["comm"]["expected"]["scheme"] == "fsdp-shard-grad-op"
    assert gradop["mixed_precision"] == "bf16" and gradop["fsdp_reshard_after_forward"] is False
    assert gradop["gloo_socket_ifname"]  # loopback chosen on the local backend


def test_profile_writes_a_trace_per_rank_into_the_run_folder(engines_report):
    path, _, by_engine = engines_report
    node = by_engine["ddp-fp16-accum2"]["nodes"]["coordinator"]
    traces = sorted(Path(node["profile_dir"]).glob("*.pt.trace.json"))
    assert [t.name.split(".")[0] for t in traces] == ["rank0", "rank1", "rank2"]
    assert Path(node["profile_dir"]).parent.parent.parent == path.parent  # <run>/point-NNN/repeat-0/profile
    assert all(t.stat().st_size > 1000 for t in traces)
    assert "profile_dir" not in by_engine["ddp"]["nodes"]["coordinator"]


def test_communication_profile(engines_report):
    _, _, by_engine = engines_report
    for label, rep in by_engine.items():
        totals = rep["totals"]
        assert totals["comm_expected_bytes_per_step"] > 0, label
        assert 0.0 < totals["comm_share"] <= 1.0, label
        assert totals["comm_measured_bytes_per_step"] is None  # local processes share the host's counters
    ddp = by_engine["ddp"]["nodes"]["coordinator"]["comm"]
    assert ddp["collectives"] >= STEPS  # at least one bucket per step went through the timed hook
    fsdp = by_engine["fsdp"]["nodes"]["coordinator"]["comm"]
    assert fsdp["collectives"] >= 3 * 2 * STEPS  # per Linear: 2 all-gathers + 1 reduce-scatter per step
    # FULL_SHARD: 3 passes of (W-1)/W against DDP's 2, plus dim-0 padding (64 and 10 rows over 3 ranks)
    ratio = by_engine["fsdp"]["totals"]["comm_expected_bytes_per_step"] / by_engine["ddp"]["totals"][
        "comm_expected_bytes_per_step"]
    assert 1.5 <= ratio < 1.6


def test_compare_prints_engines_against_ddp(engines_report):
    path, _, _ = engines_report
    out = subprocess.run([sys.executable, "-m", "harness", "compare", str(path)], cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "baseline" in out.stdout and "n<2" in out.stdout  # one repeat: ratios without a test
    for label in ("wiiide", "fsdp", "ddp-fp16-accum2"):
        assert label in out.stdout


def test_ddp_powersgd_hook_runs_past_its_start_step(tmp_path):
    """DDP with the PowerSGD hook on the digits 512-512 MLP (1.2 MB: two buckets under DDP's default
    caps) with 3 gloo ranks used to hang or abort with gloo's "collective mismatch" at the hook's start
    step; the engine now gives it one bucket. Warm-up 3 steps (the hook starts there), then 9 more."""
    spec = build_spec({
        "name": "powersgd-tiny", "repeats": 1, "timeout_s": 150,
        "base": {"dataset": "digits", "hidden_sizes": [512, 512], "num_workers": 2, "max_steps": 12,
                 "duration_s": 120, "warmup_steps": 3, "log_tier": "silent", "connect_timeout_s": 60,
                 "engine": "ddp", "ddp_comm_hook": "powersgd", "powersgd_rank": 1},
        "axes": {"batch_size": [32]},
    }, "powersgd-tiny.yaml")
    report = load_report(run_sweep(spec, "local", tmp_path, progress=lambda line: None))
    point = report["points"][0]
    assert point["status"] == "ok", point["error"]
    nodes = point["repeats"][0]["nodes"]
    assert sorted(n["rank"] for n in nodes.values()) == [0, 1, 2]
    assert all(n["steps"] == 12 for n in nodes.values())
    assert nodes["coordinator"]["comm"]["expected"]["scheme"] == "powersgd-rank-1"
