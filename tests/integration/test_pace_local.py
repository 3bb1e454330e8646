"""Workers at their own pace on the local backend: one worker slowed (debug_step_sleep_s on rank 1).

Synchronous rounds give every worker the same number of batches; ``staleness_bound: async`` lets the
fast worker run ahead, so the counts are uneven, every applied gradient's staleness is recorded and
the report carries it. Local SGD (H = 4, Nesterov outer step; and with int8 both ways) and adaptive
batches run and learn.
"""

from __future__ import annotations

import pytest

from harness.results.report import load_report_json as load_report
from harness.spec.points import build_spec
from harness.sweep import run_sweep

DURATION_S = 3  # every variant stops on time, so the slow worker's share shows
VARIANTS = [
    {"label": "sync", "staleness_bound": 0},
    {"label": "async", "staleness_bound": "async"},
    {"label": "ssp-1", "staleness_bound": 1},
    {"label": "ssp-2-cache", "staleness_bound": 2, "ssp_cache": True},
    {"label": "local-4", "staleness_bound": 0, "local_steps": 4, "outer_optimizer": "nesterov"},
    {"label": "local-4-int8", "staleness_bound": 0, "local_steps": 4, "compression": "fixed:int8",
     "lossy_warmup_steps": 1},
    {"label": "adaptive", "staleness_bound": 0, "adaptive_batch": True, "grad_accum_steps": 2},
]


@pytest.fixture(scope="module")
def pace_report(tmp_path_factory):
    spec = build_spec({
        "name": "pace-tiny", "repeats": 1,
        "base": {"dataset": "digits", "num_workers": 2, "duration_s": DURATION_S, "warmup_steps": 2,
                 "log_tier": "silent", "connect_timeout_s": 60, "debug_step_sleep_s": 0.05,
                 "debug_sleep_worker_rank": 1, "ps_shards": "1"},  # the central pace server (sharded: test_ps_paced)
        "axes": {"staleness_bound": VARIANTS},
    }, "pace-tiny.yaml")
    path = run_sweep(spec, "local", tmp_path_factory.mktemp("results"), progress=lambda line: None)
    report = load_report(path)
    return {p["params"]["staleness_bound"]: p for p in report["points"]}


def test_every_variant_runs(pace_report):
    assert set(pace_report) == {v["label"] for v in VARIANTS}
    for label, point in pace_report.items():
        assert point["status"] == "ok", (label, point["error"])


def test_synchronous_rounds_give_equal_counts(pace_report):
    totals = pace_report["sync"]["repeats"][0]["totals"]
    counts = totals["batches_per_worker"]
    assert counts["1"] == counts["2"] == totals["steps"] > 0
    assert totals["staleness_histogram"] is None  # staleness_bound 0 alone: the coordinator's own rounds


def test_async_counts_are_uneven_and_staleness_is_recorded(pace_report):
    totals = pace_report["async"]["repeats"][0]["totals"]
    counts = totals["batches_per_worker"]
    assert counts["1"] + counts["2"] == totals["steps"]  # one update per gradient
    assert counts["2"] > 2 * counts["1"] > 0  # rank 1 sleeps 50 ms per step
    hist = totals["staleness_histogram"]
    assert sum(hist.values()) == totals["steps"]
    assert totals["staleness_max"] == max(int(k) for k in hist) >= 1  # the slow worker's gradients are stale
    assert totals["samples_per_worker"] == {rank: 32 * n for rank, n in counts.items()}
    assert totals["clock_gap_max"] >= 2


def test_bounded_staleness_keeps_workers_within_the_bound(pace_report):
    totals = pace_report["ssp-1"]["repeats"][0]["totals"]
    counts = totals["batches_per_worker"]
    assert abs(counts["1"] - counts["2"]) <= 2  # at most s + 1 pushes apart when the run stops
    assert totals["clock_gap_max"] <= 2  # s ahead, plus the push that reaches the bound


def test_the_ssp_cache_sends_parameters_only_when_a_copy_is_too_stale(pace_report):
    rep = pace_report["ssp-2-cache"]["repeats"][0]
    pace = rep["nodes"]["coordinator"]["pace"]
    assert pace["ssp_cache"] is True
    # the slow worker (rank 1) is the slowest: its copy serves 2 more tasks after each refresh; the fast
    # one runs at the bound, where every task needs the newest parameters
    assert pace["tasks_with_params"] > 0 and pace["tasks_without_params"] > 0
    assert pace["tasks_with_params"] + pace["tasks_without_params"] >= rep["totals"]["steps"]
    assert rep["totals"]["clock_gap_max"] <= 3
    assert rep["totals"]["test_accuracy"] > 0.5
    fresh = pace_report["ssp-1"]["repeats"][0]["nodes"]["coordinator"]["pace"]
    assert fresh["ssp_cache"] is False and fresh["tasks_without_params"] == 0


def test_local_sgd_and_adaptive_batches_learn(pace_report):
    local = pace_report["local-4"]["repeats"][0]["totals"]
    assert local["batches_per_worker"] == {"1": 4 * local["steps"], "2": 4 * local["steps"]}
    assert local["test_accuracy"] > 0.5
    int8 = pace_report["local-4-int8"]["repeats"][0]["totals"]  # deltas and pulls in int8 (wiiide.server.pace.compress)
    assert int8["batches_per_worker"] == {"1": 4 * int8["steps"], "2": 4 * int8["steps"]}
    assert int8["test_accuracy"] > 0.5
    # the workers' deltas and the pulls travel in int8 (about 3.9x smaller); the batches, the bulk of the
    # bytes with this small model, go uncompressed
    assert int8["compression_ratio"] > 1.3 and local["compression_ratio"] == pytest.approx(1.0)
    adaptive = pace_report["adaptive"]["repeats"][0]["totals"]
    sizes = adaptive["batch_sizes_per_worker"]
    last = {rank: points[-1][1] for rank, points in sizes.items()}
    assert sum(last.values()) == 64  # 2 workers x batch_size 32
    assert last["2"] > last["1"]  # the slow worker gets the smaller share
    assert adaptive["test_accuracy"] > 0.5
    assert adaptive["staleness_histogram"] == {"0": 2 * adaptive["steps"]}  # rounds: every gradient is fresh


def test_ddp_post_local_sgd_baseline_runs(tmp_path):
    spec = build_spec({
        "name": "post-local-sgd-tiny", "repeats": 1,
        "base": {"dataset": "digits", "num_workers": 2, "max_steps": 20, "duration_s": 120, "warmup_steps": 2,
                 "log_tier": "silent", "connect_timeout_s": 60, "engine": "ddp", "ddp_comm_hook": "post_local_sgd"},
        "axes": {"local_steps": [4]},
    }, "post-local-sgd-tiny.yaml")
    point = load_report(run_sweep(spec, "local", tmp_path, progress=lambda line: None))["points"][0]
    assert point["status"] == "ok", point["error"]
    totals = point["repeats"][0]["totals"]
    assert totals["steps"] == 20 and totals["test_accuracy"] > 0.5
    assert "post-local-sgd-4" in str(point["repeats"][0]["nodes"]["coordinator"]["comm"]["expected"])


def test_async_worker_killed_then_restarted_rejoins_and_the_other_never_waits(tmp_path):
    spec = build_spec({"name": "async-kill-restart", "base": {
        "dataset": "digits", "num_workers": 2, "log_tier": "normal", "log_every_steps": 100000, "io_timeout_s": 2.0,
        "heartbeat_interval_s": 0.5, "connect_timeout_s": 30, "duration_s": 14, "staleness_bound": 2, "ps_shards": "1"},
        "faults": [{"action": "kill", "target": "worker-1", "at_s": 2},
                   {"action": "restart", "target": "worker-1", "at_s": 3}]}, "async-kill.yaml")
    rep = load_report(run_sweep(spec, "local", tmp_path, progress=lambda line: None))["points"][0]["repeats"][0]
    assert rep["status"] == "ok", rep["error"]
    events = rep["nodes"]["coordinator"]["events"]
    lost = [e for e in events if e["event"] == "worker_lost"]
    rejoined = [e for e in events if e["event"] == "worker_rejoined"]
    assert len(lost) == 1 and len(rejoined) == 1 and lost[0]["rank"] == rejoined[0]["rank"]
    assert rejoined[0]["step"] > lost[0].get("step", 0) >= 0
    totals = rep["totals"]
    killed, other = str(lost[0]["rank"]), str(3 - lost[0]["rank"])
    assert 0 < totals["batches_per_worker"][killed] < totals["batches_per_worker"][other]
    assert totals["clock_gap_max"] <= 3  # SSP held across the loss and the rejoin
    assert totals["test_accuracy"] > 0.5


def test_workers_in_the_middle_of_local_steps_when_time_is_up_end_cleanly(tmp_path):
    # 1.2 MB deltas (more than a socket buffer) and 0.1 s per local step: every worker is mid-push at
    # the end; the server waits for those pushes before it says stop and closes, so none breaks a pipe.
    spec = build_spec({"name": "pace-drain", "repeats": 1, "base": {
        "dataset": "digits", "hidden_sizes": [512, 512], "num_workers": 2, "duration_s": 2, "log_tier": "silent",
        "connect_timeout_s": 60, "local_steps": 4, "debug_step_sleep_s": 0.1, "ps_shards": "1"}, "axes": {}},
        "pace-drain.yaml")
    rep = load_report(run_sweep(spec, "local", tmp_path, progress=lambda line: None))["points"][0]["repeats"][0]
    assert rep["status"] == "ok", rep["error"]
    assert {name: node["status"] for name, node in rep["nodes"].items()} == {
        "coordinator": "ok", "worker-1": "ok", "worker-2": "ok"}
    assert rep["totals"]["steps"] >= 1
