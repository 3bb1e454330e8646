"""Sharded servers (``ps_shards: all``) at the workers' own pace on the local backend, one worker slowed
(debug_step_sleep_s on rank 1): async, a staleness bound of 2, and adaptive batches in rounds and under
the bound, each also with local SGD (H = 4 steps a push), and the SSP cache under the bound. Each trains (the loss falls, a held-out accuracy is reported) and records the pace record the
central pace server records (`wiiide.server.pace.record`). What stays unsupported is refused up front.
"""

from __future__ import annotations

import pytest

from harness.results.report import load_report_json as load_report
from harness.spec.points import build_spec
from harness.sweep import run_sweep
from wiiide.config import RunConfig
from wiiide.errors import ConfigError

DURATION_S = 4
VARIANTS = [
    {"label": "async", "staleness_bound": "async"},
    {"label": "ssp-2", "staleness_bound": 2, "staleness_scaling": "inverse"},
    {"label": "ssp-2-cache", "staleness_bound": 2, "ssp_cache": True},
    {"label": "0+adaptive", "staleness_bound": 0, "adaptive_batch": True},
    {"label": "2+adaptive-int8", "staleness_bound": 2, "adaptive_batch": True, "compression": "fixed:int8",
     "lossy_warmup_steps": 2},
    {"label": "2+local-4", "staleness_bound": 2, "local_steps": 4},
    {"label": "async+local-4-nesterov", "staleness_bound": "async", "local_steps": 4, "outer_optimizer": "nesterov",
     "outer_learning_rate": 0.7},
    {"label": "0+adaptive+local-4", "staleness_bound": 0, "adaptive_batch": True, "local_steps": 4},
]
LOCAL = ("2+local-4", "async+local-4-nesterov", "0+adaptive+local-4")


@pytest.fixture(scope="module")
def paced(tmp_path_factory):
    spec = build_spec({
        "name": "ps-paced-tiny", "repeats": 1,
        "base": {"dataset": "digits", "num_workers": 2, "ps_shards": "all", "duration_s": DURATION_S,
                 "warmup_steps": 2, "log_tier": "silent", "connect_timeout_s": 60, "debug_step_sleep_s": 0.05,
                 "debug_sleep_worker_rank": 1, "eval_every_s": 1},
        "axes": {"staleness_bound": VARIANTS},
    }, "ps-paced-tiny.yaml")
    report = load_report(run_sweep(spec, "local", tmp_path_factory.mktemp("results"), progress=lambda line: None))
    return {p["params"]["staleness_bound"]: p for p in report["points"]}


def _totals(paced, label):
    point = paced[label]
    assert point["status"] == "ok", (label, point["error"])
    return point["repeats"][0]["totals"], point["repeats"][0]["nodes"]


def _learned(totals, nodes):
    losses = nodes["coordinator"]["losses"] if "losses" in nodes["coordinator"] else None
    assert totals["test_accuracy"] > 0.5
    assert totals["loss_final"] < 1.5  # digits starts at ln(10) = 2.3
    if losses:
        assert losses[-1] < losses[0]


@pytest.mark.parametrize("label", [v["label"] for v in VARIANTS])
def test_every_pacing_trains_on_the_shards(paced, label):
    totals, nodes = _totals(paced, label)
    _learned(totals, nodes)
    assert nodes["coordinator"]["pace"]["placement"] == "sharded"
    assert sum(totals["pushes_per_worker"].values()) == totals["batches"]
    assert totals["samples_per_worker"] and sum(totals["samples_per_worker"].values()) > 0


def test_sharded_async_lets_the_fast_worker_run_ahead(paced):
    totals, _ = _totals(paced, "async")
    counts = totals["batches_per_worker"]
    assert counts["1"] + counts["2"] == totals["steps"]  # one update of every partition per push
    assert counts["2"] > 2 * counts["1"] > 0  # rank 1 sleeps 50 ms per step
    hist = totals["staleness_histogram"]
    assert sum(hist.values()) == totals["steps"]
    assert totals["staleness_max"] >= 1  # the slow worker's pushes land on partitions the fast one moved
    assert totals["clock_gap_max"] >= 2
    assert totals["samples_per_worker"] == {rank: 32 * n for rank, n in counts.items()}


def test_sharded_staleness_bound_holds_the_clock_gap(paced):
    totals, _ = _totals(paced, "ssp-2")
    counts = totals["batches_per_worker"]
    assert abs(counts["1"] - counts["2"]) <= 3  # at most s + 1 pushes apart when the run stops
    assert totals["clock_gap_max"] <= 3  # s ahead, plus the push that reaches the bound
    assert sum(totals["staleness_histogram"].values()) == totals["steps"]


def test_sharded_adaptive_batches_shift_samples_to_the_fast_worker(paced):
    for label in ("0+adaptive", "2+adaptive-int8"):
        totals, _ = _totals(paced, label)
        last = {rank: points[-1][1] for rank, points in totals["batch_sizes_per_worker"].items()}
        assert sum(last.values()) == 64, label  # 2 workers x batch_size 32: the global batch kept
        assert last["2"] > last["1"], label  # the slow worker gets the smaller share
    rounds, _ = _totals(paced, "0+adaptive")
    assert rounds["batches_per_worker"] == {"1": rounds["steps"], "2": rounds["steps"]}
    assert rounds["staleness_histogram"] == {"0": 2 * rounds["steps"]}  # rounds: every push is fresh
    assert rounds["samples_per_worker"]["2"] > rounds["samples_per_worker"]["1"]


def _cached_pulls(nodes) -> int:
    return sum(((node.get("ps") or {}).get("shard") or {}).get("pulls_cached", 0) for node in nodes.values())


def test_the_ssp_cache_on_the_shards_answers_a_push_without_parameters_while_the_copy_is_fresh(paced):
    totals, nodes = _totals(paced, "ssp-2-cache")
    assert _cached_pulls(nodes) > 0
    assert _cached_pulls(_totals(paced, "ssp-2")[1]) == 0  # off: every push answered with the partition
    # a task without parameters is one whose every partition the copy served: each reported task is one update
    pace, partitions = nodes["coordinator"]["pace"], nodes["worker-1"]["ps"]["partitions"]
    assert pace["tasks_with_params"] + pace["tasks_without_params"] == pace["updates"]
    assert 0 < pace["tasks_without_params"] * partitions <= _cached_pulls(nodes)
    off = _totals(paced, "ssp-2")[1]["coordinator"]["pace"]
    assert off["tasks_without_params"] == 0 and off["tasks_with_params"] == off["updates"]
    assert totals["clock_gap_max"] <= 3  # the bound still holds the clocks
    # a cached copy misses the versions applied since it was sent: the next push is stale by them
    assert totals["staleness_max"] >= 1 and sum(totals["staleness_histogram"].values()) == totals["steps"]


@pytest.mark.parametrize("fields, match", [
    ({"model": "embedding", "sparse_embedding": True, "momentum": 0, "staleness_bound": 2, "local_steps": 4,
      "outer_optimizer": "nesterov"}, "sparse_embedding.*outer_optimizer nesterov"),
])
def test_what_sharded_pacing_does_not_take_is_refused_with_its_reason(fields, match):
    with pytest.raises(ConfigError, match=match):
        RunConfig(ps_shards="all", num_workers=2, **fields)


@pytest.mark.parametrize("label", LOCAL)
def test_sharded_local_sgd_pushes_a_delta_per_h_batches_at_any_pace(paced, label):
    totals, nodes = _totals(paced, label)
    pace = nodes["coordinator"]["pace"]
    assert pace["local_steps"] == 4 and pace["placement"] == "sharded"
    counts = totals["batches_per_worker"]
    if label.startswith("0+"):  # rounds of adaptive batches: a round's tasks sum to H x the global batch
        assert counts == {"1": totals["steps"], "2": totals["steps"]}
        assert sum(totals["samples_per_worker"].values()) == 4 * 64 * totals["steps"]
        last = {rank: points[-1][1] for rank, points in totals["batch_sizes_per_worker"].items()}
        assert last["2"] > last["1"]  # the slow worker gets the smaller share
    else:  # one update per push, each push H batches of 32
        assert counts["1"] + counts["2"] == totals["steps"]
        assert totals["samples_per_worker"] == {rank: 4 * 32 * n for rank, n in counts.items()}
        assert counts["2"] > counts["1"] > 0  # rank 1 sleeps 50 ms after each of its 4 local steps
