"""Engines side by side: the communication profiler's formulas, rank assignment, the Training Summary,
engine options in configs and specs, per-repeat engine totals, and `harness compare` (Welch's t-test)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from harness.errors import HarnessError
from harness.present.compare import (
    compare,
    compare_engines,
    pool_points,
    engine_rows,
    compare_reports,
    verdict,
    welch_p_value,
)
from harness.results.report import as_report
from harness.results.totals import repeat_totals
from harness.spec.points import build_spec
from wiiide.config import RunConfig
from wiiide.engines.comm import (
    IntervalTimer,
    estimate,
    fsdp_padded_elements,
    parameter_server,
    powersgd_elements,
    ring_factor,
    union_length_s,
)
from wiiide.errors import ConfigError
from wiiide.summary import format_summary, training_summary

REPO_ROOT = Path(__file__).resolve().parents[2]
# digits MLP 64-512-512-10: weights are (out, in)
MLP_SHAPES = [(512, 64), (512,), (512, 512), (512,), (10, 512), (10,)]
MLP_NUMEL = sum(math.prod(shape) for shape in MLP_SHAPES)


# --- the communication profiler ---------------------------------------------------------------
def test_mlp_numel_is_the_readme_figure():
    assert MLP_NUMEL == 301_066  # 1.2 MB of fp32 gradient


def test_parameter_server_moves_two_x_workers_x_params_through_the_coordinator():
    est = parameter_server(1000, 4, data_bytes_per_step=50)
    assert est.bottleneck_node == "coordinator"
    assert est.bottleneck_bytes == 2 * 4 * 1000
    assert est.total_bytes == 8000  # 4 x params out, 4 x gradients back
    assert est.per_rank_sent_bytes == est.per_rank_received_bytes == 1000
    assert est.world_size == 5 and est.data_bytes == 50
    with pytest.raises(ValueError):
        parameter_server(1000, 0)


@pytest.mark.parametrize("world, factor", [(1, 0.0), (2, 1.0), (3, 4 / 3), (5, 8 / 5), (9, 16 / 9)])
def test_ring_factor_is_two_n_minus_one_over_n(world, factor):
    assert ring_factor(world) == pytest.approx(factor)


def test_ddp_ring_all_reduce_bytes_per_rank_and_total():
    est = estimate("ddp", MLP_SHAPES, num_workers=2)
    p = MLP_NUMEL * 4
    assert est.world_size == 3 and est.param_bytes == p
    assert est.per_rank_sent_bytes == pytest.approx(2 * 2 / 3 * p)
    assert est.total_bytes == pytest.approx(3 * 2 * 2 / 3 * p)  # = 2 (W-1) P, as the parameter server's 2 N P
    assert est.total_bytes == pytest.approx(estimate("wiiide", MLP_SHAPES, 2).total_bytes)
    # ... but spread over every link: the parameter server's busiest link carries W/2 times more
    assert estimate("wiiide", MLP_SHAPES, 2).bottleneck_bytes == pytest.approx(1.5 * est.bottleneck_bytes)
    assert estimate("ddp", MLP_SHAPES, 2, ddp_comm_hook="fp16").total_bytes == pytest.approx(est.total_bytes / 2)


def test_powersgd_compresses_only_matrices_worth_it():
    # rank 1: 512x64 -> 576 (32768 > 2 x 576), 512x512 -> 1024, 10x512 -> 522 (5120 > 1044); biases whole
    assert powersgd_elements(MLP_SHAPES, rank=1) == 576 + 1024 + 522 + 512 + 512 + 10
    # rank 8: 10x512 would be 4176 values, 5120 < 2 x 4176, so it goes uncompressed
    assert powersgd_elements(MLP_SHAPES, rank=8) == 8 * 576 + 8 * 1024 + 5120 + 512 + 512 + 10
    est = estimate("ddp", MLP_SHAPES, 2, ddp_comm_hook="powersgd", powersgd_rank=1)
    assert est.per_rank_sent_bytes == pytest.approx(4 / 3 * 4 * 3156)


def test_fsdp_gathers_twice_when_resharding_and_pads_dim0():
    assert fsdp_padded_elements([(10, 512)], 4) == 12 * 512  # 10 rows padded to 12 for 4 ranks
    assert fsdp_padded_elements([(10,)], 3) == 12
    full = estimate("fsdp", [(12, 5)], num_workers=2)
    grad_op = estimate("fsdp", [(12, 5)], num_workers=2, fsdp_reshard_after_forward=False)
    per_pass = 2 / 3 * 60 * 4
    assert full.per_rank_sent_bytes == pytest.approx(3 * per_pass)  # 2 all-gathers + reduce-scatter
    assert grad_op.per_rank_sent_bytes == pytest.approx(2 * per_pass)  # = DDP's ring all-reduce
    assert grad_op.per_rank_sent_bytes == pytest.approx(estimate("ddp", [(12, 5)], 2).per_rank_sent_bytes)
    bf16 = estimate("fsdp", [(12, 5)], 2, param_dtype_bytes=2)
    assert bf16.per_rank_sent_bytes == pytest.approx(per_pass * (2 * 2 + 4) / 4)


def test_estimate_rejects_unknown_engine_and_hook():
    with pytest.raises(ValueError):
        estimate("horovod", MLP_SHAPES, 2)
    with pytest.raises(ValueError):
        estimate("ddp", MLP_SHAPES, 2, ddp_comm_hook="bf16")


def test_union_length_counts_overlaps_once():
    assert union_length_s([]) == 0.0
    assert union_length_s([(0.0, 1.0), (0.5, 2.0), (3.0, 3.5)]) == pytest.approx(2.5)
    assert union_length_s([(3.0, 3.5), (0.0, 1.0), (1.0, 1.25)]) == pytest.approx(1.75)  # unsorted, touching
    assert union_length_s([(0.0, 4.0), (1.0, 2.0)]) == pytest.approx(4.0)  # nested
    with pytest.raises(ValueError):
        union_length_s([(2.0, 1.0)])


def test_interval_timer_from_threads_and_per_step():
    timer = IntervalTimer()
    threads = [threading.Thread(target=timer.add, args=(float(i), float(i) + 0.5)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert timer.take_step() == pytest.approx(4.0)
    assert timer.take_step() == 0.0  # cleared
    assert timer.count == 8


# --- rank assignment ---------------------------------------------------------------------------
def test_ranks_from_the_store_counter_are_distinct_and_bounded(free_port):
    from datetime import timedelta

    import torch.distributed as dist

    from wiiide.engines.rendezvous import claim_rank
    from wiiide.wire.node import EXIT_CONNECT, NodeFailure

    master = dist.TCPStore("127.0.0.1", free_port, is_master=True, timeout=timedelta(seconds=20),
                           wait_for_workers=False)
    assert claim_rank(master, "coordinator", 8) == 0  # the coordinator does not draw
    ranks: list[int] = []

    def draw() -> None:
        client = dist.TCPStore("127.0.0.1", free_port, is_master=False, timeout=timedelta(seconds=20))
        ranks.append(claim_rank(client, "worker", 8))

    threads = [threading.Thread(target=draw) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert sorted(ranks) == list(range(1, 9))
    with pytest.raises(NodeFailure) as info:
        claim_rank(master, "worker", 8)  # a ninth worker
    assert info.value.exit_code == EXIT_CONNECT and "num_workers=8" in str(info.value)


def test_rank_slices_split_the_global_batch():
    from wiiide.engines.rendezvous import rank_slices

    slices = rank_slices(64, 3)
    assert [s.stop - s.start for s in slices] == [22, 21, 21]
    assert slices[0].start == 0 and slices[-1].stop == 64
    assert all(a.stop == b.start for a, b in zip(slices, slices[1:]))
    assert [s.stop - s.start for s in rank_slices(256, 9)] == [29] * 4 + [28] * 5
    with pytest.raises(ValueError):
        rank_slices(2, 3)


# --- the Training Summary ----------------------------------------------------------------------
def test_training_summary_leaves_out_warmup_and_uses_the_guides_throughput():
    steps = [1.0, 0.9] + [0.1, 0.2, 0.3]
    s = training_summary(steps, [3.0, 2.0, 1.0, 0.5, 0.25], 2, 64, [100, 300], 400)
    assert (s["num_steps"], s["warmup_steps"], s["total_steps"]) == (3, 2, 5)
    assert s["avg_step_time_s"] == pytest.approx(0.2)
    assert (s["min_step_time_s"], s["max_step_time_s"]) == (0.1, 0.3)
    assert s["throughput_samples_per_s"] == pytest.approx(64 / 0.2)
    assert s["avg_loss"] == pytest.approx(6.75 / 5) and s["final_loss"] == 0.25
    assert (s["peak_rss_bytes"], s["avg_rss_bytes"]) == (400, 200)
    assert "Training Summary" in format_summary(s) and "num_steps: 3" in format_summary(s)


def test_training_summary_of_warmup_only_run_has_no_timings():
    s = training_summary([0.5, 0.5], [1.0, 1.0], 10, 64, [], None)
    assert s["num_steps"] == 0 and s["warmup_steps"] == 2
    assert s["avg_step_time_s"] is None and s["throughput_samples_per_s"] is None


def test_node_metrics_carry_the_training_summary():
    from wiiide.metrics import NodeMetrics

    m = NodeMetrics("coordinator", "c")
    m.warmup_steps = 1
    m.step_times_s = [5.0, 0.5, 0.5]
    m.steps, m.samples = 3, 192
    m.losses = [2.0, 1.0, 0.5]
    s = m.to_dict("ok")["training_summary"]
    assert s["num_steps"] == 2 and s["samples_per_step"] == 64
    assert s["throughput_samples_per_s"] == pytest.approx(128)
    assert s["avg_rss_bytes"] > 0


# --- engine options in configs and specs -------------------------------------------------------
def test_engine_options_validate_and_refuse_what_the_engine_cannot_apply():
    assert RunConfig().engine == "wiiide" and RunConfig().warmup_steps == 10
    RunConfig(engine="ddp", ddp_comm_hook="powersgd", powersgd_rank=4, grad_accum_steps=2, mixed_precision="bf16")
    RunConfig(engine="fsdp", fsdp_reshard_after_forward=False, profile=True)
    bad = [dict(engine="horovod"), dict(engine="ddp", ddp_comm_hook="int8"),
           dict(engine="fsdp", ddp_comm_hook="fp16"), dict(engine="ddp", fsdp_reshard_after_forward=False),
           dict(grad_accum_steps=33), dict(mixed_precision="fp8"), dict(profile=True),
           dict(engine="ddp", powersgd_rank=4), dict(engine="ddp", compression="zlib-1"),
           dict(engine="ddp", num_workers=2, batch_size=1, grad_accum_steps=2), dict(warmup_steps=-1)]
    for kwargs in bad:
        with pytest.raises(ConfigError):
            RunConfig(**kwargs)
    env = RunConfig(engine="fsdp", fsdp_reshard_after_forward=False).to_env()
    assert RunConfig.from_env(env).fsdp_reshard_after_forward is False


def test_spec_variants_set_several_fields_and_are_labelled():
    spec = build_spec({"name": "v", "axes": {"engine": [
        "wiiide", {"label": "ddp-fp16", "engine": "ddp", "ddp_comm_hook": "fp16"},
        {"engine": "fsdp", "fsdp_reshard_after_forward": False}], "workers": [2, 4]}}, "v.yaml")
    assert [p.params["engine"] for p in spec.points] == ["wiiide", "wiiide", "ddp-fp16", "ddp-fp16",
                                                        "fsdp/False", "fsdp/False"]
    assert spec.points[2].config.ddp_comm_hook == "fp16" and spec.points[3].config.num_workers == 4
    assert spec.points[4].config.fsdp_reshard_after_forward is False
    with pytest.raises(Exception) as info:
        build_spec({"name": "v", "axes": {"engine": [{"engine": "ddp", "ddp_comm_hook": "int8"}]}}, "v.yaml")
    assert "axes.engine[0]" in str(info.value) and "ddp_comm_hook" in str(info.value)


# --- per-repeat engine totals ------------------------------------------------------------------
def _node(role, **fields):
    base = {"role": role, "status": "ok", "steps": 20, "iface_bytes_sent": 0, "iface_bytes_recv": 0,
            "peak_rss_bytes": 1000, "training_summary": {"avg_rss_bytes": 500}}
    return {**base, **fields}


def test_engine_totals_of_the_parameter_server():
    coord = _node("coordinator", gradient_bytes=1000, num_workers=2, payload_bytes_sent=20 * (2 * 1000 + 100),
                  step_time_s={"mean": 0.01}, iface_bytes_sent=20 * 2100, iface_bytes_recv=20 * 2000,
                  training_summary={"throughput_samples_per_s": 6400.0, "avg_step_time_s": 0.01, "num_steps": 10,
                                    "avg_rss_bytes": 500})
    workers = {f"worker-{i}": _node("worker", compute_time_s=20 * 0.004, iface_bytes_sent=20 * 1000,
                                    iface_bytes_recv=20 * 1050) for i in (1, 2)}
    nodes = {"coordinator": coord, **workers}
    docker = {"c": {"kind": "container"}}
    t = repeat_totals(nodes, docker)
    assert t.engine == "wiiide" and t.world_size == 3
    assert t.comm_expected_bytes_per_step == 4000  # 2 x 2 workers x 1000
    assert t.comm_measured_bytes_per_step == pytest.approx(2100 + 2 * 1000)
    assert t.comm_measured_over_expected == pytest.approx(4100 / 4000)
    assert t.comm_share == pytest.approx(1 - 0.004 / 0.01)
    assert t.throughput_samples_per_s == 6400.0 and t.rss_peak_sum_bytes == 3000
    assert t.link_rate_bps is None and t.coordinator_egress_utilisation is None  # no link shaped
    local = repeat_totals(nodes, {"c": {"kind": "process"}})
    assert local.comm_measured_bytes_per_step is None  # processes share the host's counters


def test_engine_totals_of_a_torch_engine_use_its_own_profile():
    comm = {"expected": {"total_bytes": 3000.0, "bottleneck_bytes": 2000.0}, "share_of_step_time": 0.4}
    nodes = {"coordinator": _node("coordinator", engine="ddp", world_size=3, num_workers=2, comm=comm,
                                  iface_bytes_sent=20 * 1100),
             "worker-1": _node("worker", iface_bytes_sent=20 * 1000), "worker-2": _node("worker", iface_bytes_sent=20 * 1000)}
    t = repeat_totals(nodes, {"c": {"kind": "container"}})
    assert t.engine == "ddp" and t.comm_share == 0.4
    assert t.comm_expected_bytes_per_step == 3000.0
    assert t.comm_measured_bytes_per_step == pytest.approx(3100)


# --- harness compare ---------------------------------------------------------------------------
def test_welch_p_value_on_known_samples():
    # Welch's t = -1.8974, df = 5.882 (Welch-Satterthwaite); two-sided p = 0.1075 (R: t.test(a, b))
    assert welch_p_value([1, 2, 3, 4, 5], [2, 4, 6, 8, 10]) == pytest.approx(0.1075, abs=5e-4)
    # clearly apart: p far below 0.05
    assert welch_p_value([10.0, 10.2, 9.9, 10.1], [12.0, 12.3, 11.8, 12.1]) < 1e-4
    assert welch_p_value([1.0], [2.0, 3.0]) is None  # one repeat: no test
    assert welch_p_value([2.0, 2.0], [2.0, 2.0]) == 1.0 and welch_p_value([1.0, 1.0], [2.0, 2.0]) == 0.0


def _point(index, params, values, acc=0.9):
    return {"index": index, "params": params, "status": "ok",
            "repeats": [{"repeat": i, "status": "ok", "totals": {"throughput_samples_per_s": v, "test_accuracy": acc}}
                        for i, v in enumerate(values)]}


def _report(points, name="r"):
    names = sorted({k for p in points for k in p["params"]})
    return {"name": name, "param_names": names, "points": points, "complete": True}


def test_compare_engines_groups_by_the_other_params_against_ddp():
    report = _report([
        _point(0, {"engine": "wiiide", "workers": 2}, [130.0, 131.0, 129.0]),
        _point(1, {"engine": "ddp", "workers": 2}, [100.0, 101.0, 99.0]),
        _point(2, {"engine": "fsdp", "workers": 2}, [90.0, 120.0, 95.0]),
        _point(3, {"engine": "wiiide", "workers": 4}, [50.0, 52.0, 51.0]),
        _point(4, {"engine": "ddp", "workers": 4}, [100.0, 102.0, 98.0]),
    ])
    rows = {(r.group["workers"], r.label): r for r in compare_engines(report)}
    assert set(rows) == {(2, "wiiide"), (2, "ddp"), (2, "fsdp"), (4, "wiiide"), (4, "ddp")}
    fast = rows[(2, "wiiide")]
    assert fast.reference == "ddp" and fast.ratio == pytest.approx(1.3) and fast.significant is True
    assert verdict(fast).startswith("1.30x (p=")
    noisy = rows[(2, "fsdp")]
    assert noisy.significant is False and verdict(noisy).startswith("~1.02x ns")
    assert rows[(4, "wiiide")].ratio == pytest.approx(0.51) and rows[(4, "wiiide")].significant is True
    assert verdict(rows[(2, "ddp")]) == "baseline"
    by_wiiide = compare_engines(report, baseline="wiiide")
    assert {r.reference for r in by_wiiide} == {"wiiide"}
    with pytest.raises(HarnessError):
        compare_engines(report, baseline="horovod")
    with pytest.raises(HarnessError):
        compare_engines(_report([_point(0, {"workers": 2}, [1.0])]))


def test_compare_leaves_out_a_group_whose_baseline_did_not_run(tmp_path):
    # A sweep stopped (SIGINT) after the 100 Mbit/s engines and the first engine of 200 Mbit/s.
    report = _report([
        _point(0, {"engine": "wiiide", "link": "rate-100m"}, [130.0, 131.0, 129.0]),
        _point(1, {"engine": "ddp", "link": "rate-100m"}, [100.0, 101.0, 99.0]),
        _point(2, {"engine": "wiiide", "link": "rate-200m"}, [250.0]),
    ])
    rows, skipped = engine_rows(report)
    assert [(r.group["link"], r.label) for r in rows] == [("rate-100m", "wiiide"), ("rate-100m", "ddp")]
    assert len(skipped) == 1 and "rate-200m" in skipped[0] and "'ddp'" in skipped[0]
    assert compare_engines(report) == rows
    path = tmp_path / "report.json"
    path.write_text(json.dumps(report))
    text = compare([str(path)])
    assert "1.30x" in text and skipped[0] in text
    with pytest.raises(HarnessError, match="horovod"):
        compare_engines(report, baseline="horovod")
    with pytest.raises(HarnessError, match="'ddp' is not in group"):
        engine_rows(_report([_point(0, {"engine": "wiiide", "link": "rate-200m"}, [1.0])]), baseline="ddp")


def test_compare_pooled_over_seeds_sets_each_engines_seeds_against_the_baselines(tmp_path):
    """Seeds as the sample: one repeat per seed, pooled per engine (and per worker count); a single seed's
    difference is no verdict, five seeds' are."""
    acc = {"ddp": [0.70, 0.80, 0.75, 0.85, 0.78], "close": [0.71, 0.79, 0.76, 0.84, 0.79],
           "worse": [0.60, 0.70, 0.64, 0.74, 0.68]}
    points = [_point(i, {"engine": engine, "seed": seed, "workers": 4}, [1.0], acc=acc[engine][seed])
              for i, (engine, seed) in enumerate((e, s) for e in acc for s in range(5))]
    points[-1]["status"] = "partial"
    report = _report(points)
    plain = compare_engines(report, metric="test_accuracy")
    assert len(plain) == 15 and all(r.p_value is None for r in plain)  # one value a point: no test
    rows, skipped = engine_rows(report, metric="test_accuracy", pool="seed")
    by = {r.label: r for r in rows}
    assert not skipped and set(by) == set(acc) and all(r.group == {"workers": 4} and r.n == 5 for r in rows)
    assert by["close"].mean == pytest.approx(0.778) and by["close"].ref_mean == pytest.approx(0.776)
    assert by["close"].significant is False and by["worse"].significant is True
    pooled = pool_points(as_report(report), "seed")
    assert [p.status for p in pooled.points] == ["ok", "ok", "partial"] and pooled.param_names == ["engine", "workers"]
    path = tmp_path / "r.json"
    path.write_text(json.dumps(report))
    text = compare([str(path)], metric="test_accuracy", pool="seed")
    assert "pooled over seed" in text and "~1.00x ns" in text and "0.87x (p=" in text
    for bad, match in (("engine", "cannot pool"), ("lr", "no 'lr' axis")):
        with pytest.raises(HarnessError, match=match):
            engine_rows(report, metric="test_accuracy", pool=bad)
    with pytest.raises(HarnessError, match="one report"):
        compare([str(path), str(path)], pool="seed")


def test_compare_two_reports_matches_points_by_params(tmp_path):
    a = _report([_point(0, {"workers": 2}, [10.0, 11.0, 10.5]), _point(1, {"workers": 4}, [5.0, 5.0, 5.0])], "a")
    b = _report([_point(0, {"workers": 2}, [20.0, 21.0, 20.5]), _point(1, {"workers": 8}, [1.0, 1.0, 1.0])], "b")
    rows, unmatched = compare_reports(a, b)
    assert len(rows) == 1 and rows[0].ratio == pytest.approx(20.5 / 10.5) and rows[0].significant
    assert sorted(unmatched) == ["only in A: {'workers': 4}", "only in B: {'workers': 8}"]
    pa, pb = tmp_path / "a.json", tmp_path / "b.json"
    pa.write_text(json.dumps(a))
    pb.write_text(json.dumps(b))
    out_json = tmp_path / "cmp.json"
    text = compare([str(pa), str(pb)], json_path=str(out_json))
    assert "1.95x (p=" in text and "only in B" in text
    assert json.loads(out_json.read_text())["rows"][0]["ratio"] == pytest.approx(20.5 / 10.5)


def test_compare_cli_prints_the_table_and_fails_in_one_line(tmp_path):
    path = tmp_path / "r.json"
    path.write_text(json.dumps(_report([_point(0, {"engine": "wiiide"}, [3.0, 3.1, 2.9]),
                                        _point(1, {"engine": "ddp"}, [1.0, 1.1, 0.9])])))
    out = subprocess.run([sys.executable, "-m", "harness", "compare", str(path)], cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "3.00x (p=" in out.stdout and "baseline" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "harness", "compare", str(path), "--metric", "nope"],
                         cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and bad.stderr.strip().startswith("error:") and len(bad.stderr.strip().splitlines()) == 1


def test_return_freed_memory_fixes_glibcs_mmap_and_trim_thresholds():
    from wiiide.engines.allocator import MMAP_THRESHOLD_BYTES, return_freed_memory

    class FakeLibc:
        def __init__(self, answer: int) -> None:
            self.calls: list[tuple[int, int]] = []
            self.answer = answer

        def mallopt(self, param: int, value: int) -> int:
            self.calls.append((param, value))
            return self.answer

    libc = FakeLibc(1)
    assert return_freed_memory(libc) == {"mmap_threshold_bytes": MMAP_THRESHOLD_BYTES,
                                         "trim_threshold_bytes": MMAP_THRESHOLD_BYTES}
    assert libc.calls == [(-3, MMAP_THRESHOLD_BYTES), (-1, MMAP_THRESHOLD_BYTES)]  # M_MMAP_THRESHOLD, M_TRIM_THRESHOLD
    assert return_freed_memory(FakeLibc(0)) is None  # glibc refused: recorded as not applied
    assert return_freed_memory(object()) is None  # no mallopt (not glibc)
