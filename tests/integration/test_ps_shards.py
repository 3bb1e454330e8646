"""Sharded parameter servers (wiiide/server/ps/) on loopback: ``python -m wiiide`` subprocesses.

- central (ps_shards 1) and sharded (ps_shards all) training from the same seed reach the same
  parameters after 20 steps (fp32; the coordinator's ``params_digest``);
- a lossy codec both ways keeps every worker's copy equal to the shards' parameters (delta pulls);
- a worker holding a shard that dies fails the run cleanly, with the cause named.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest

from tests.integration.local_run import run_nodes
from tests.unit.conftest import free_port, node_env, node_procs  # noqa: F401  (fixtures)

RUN = {"num_workers": 3, "hidden_sizes": "64,64", "max_steps": 20, "duration_s": 120, "momentum": 0.9,
       "learning_rate": 0.05, "seed": 3, "partition_bytes": "8KiB"}


def _run(node_env, node_procs, metrics_dir: Path, **fields) -> dict:  # noqa: F811
    return run_nodes(node_env, node_procs, metrics_dir, {**RUN, **fields})


@pytest.mark.parametrize("balance, schedule, placement", [
    ("egress", "concurrent", "contiguous"), ("pipeline", "concurrent", "contiguous"),
    ("pipeline", "ordered", "contiguous"), ("pipeline", "ordered", "interleaved")])
def test_central_and_sharded_reach_the_same_parameters(tmp_path, node_env, node_procs, balance, schedule,  # noqa: F811
                                                       placement):
    central = _run(node_env, node_procs, tmp_path / "central", ps_shards=1)
    pieces = {"partition_bytes": 4096} if placement == "interleaved" else {}  # several pieces per shard to deal
    sharded = _run(node_env, node_procs, tmp_path / "sharded", ps_shards="all", partition_balance=balance,
                   push_schedule=schedule, partition_placement=placement, **pieces)
    c, s = central["coordinator"]["params_digest"], sharded["coordinator"]["params_digest"]
    assert central["coordinator"]["steps"] == sharded["coordinator"]["steps"] == 20
    assert c["numel"] == s["numel"] == 64 * 64 + 64 + 64 * 64 + 64 + 64 * 10 + 10
    for a, b in zip([c["sum"], c["l2"], *c["projections"]], [s["sum"], s["l2"], *s["projections"]]):
        assert math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-4), (c, s)
    ps = sharded["coordinator"]["ps"]
    assert ps["ps_shards"] == 4 and len(ps["shard_loads_bytes"]) == 4 and min(ps["shard_loads_bytes"]) > 0
    assert ps["partition_placement"] == placement and (placement == "contiguous" or ps["partitions"] >= 2 * 4)
    assert sharded["worker-1"]["ps"]["tcp_congestion"] == "reno"  # shard_tcp_congestion: auto
    cwnd = sharded["worker-1"]["ps"]["push_cwnd"]  # TCP_INFO as its pushes to the other shards started
    assert cwnd["samples"] >= 20 and cwnd["median_bytes"] > 0
    assert set(ps["batch_handout"].values()) == {"indices"}  # every worker holds the digits set
    for rank in (1, 2, 3):
        w = sharded[f"worker-{rank}"]
        assert w["steps"] == 20 and w["ps"]["batch_handout"] == "indices"
        assert w["ps"]["param_max_abs_diff"] == 0.0  # fp32 pulls: the worker's copy is the shard's
        for run in (central, sharded):  # the training thread's CPU in forward and backward: within its wall time
            assert 0 < run[f"worker-{rank}"]["compute_cpu_s"] <= run[f"worker-{rank}"]["compute_time_s"] + 0.01
    assert sharded["worker-1"]["ps"]["shard"]["updates"] == 20 * sharded["worker-1"]["ps"]["shard"]["partitions"]
    # each timed step's slowest worker's forward and backward: no longer than all three workers' together
    slowest = sharded["coordinator"]["compute_max_s"]
    assert slowest["count"] == sharded["coordinator"]["step_cpu_s"]["count"] > 0
    assert 0 < slowest["mean"] * slowest["count"] <= sum(sharded[f"worker-{r}"]["compute_time_s"] for r in (1, 2, 3))
    median = sharded["coordinator"]["compute_median_s"]
    assert median["count"] == slowest["count"] and 0 < median["median"] <= slowest["median"]
    assert central["coordinator"]["compute_max_s"] is None
    # the round's CPU by stage, on the threads that did it: within each process's CPU
    timed = sharded["coordinator"]["step_cpu_s"]["count"]
    for name, node in sharded.items():
        stages = node["stage_cpu_s"]
        expected = {"push_receive", "push_decode", "update", "pull_send"} | (
            {"push_encode", "push_send", "pull_receive", "pull_decode"} if name.startswith("worker") else set())
        assert set(stages) == expected and all(s["count"] == timed for s in stages.values()), (name, stages)
        assert sum(s["mean"] * s["count"] for s in stages.values()) <= node["cpu_time_s"]
        # every node's threads' wait for a CPU, read every 10 timed steps (the node's reader, sender and
        # training threads at least)
        delay = node["run_delay_s"]
        assert delay["steps"] >= 10 and delay["steps"] % 10 == 0 and delay["threads"] >= 3
        assert 0 <= delay["per_step_s"] * delay["steps"] <= node["wall_time_s"] * delay["threads"]
    assert central["coordinator"]["stage_cpu_s"] is None
    assert abs(central["coordinator"]["test_accuracy"] - sharded["coordinator"]["test_accuracy"]) < 0.01


def test_lossy_both_ways_keeps_the_workers_copy_on_the_shards(tmp_path, node_env, node_procs):  # noqa: F811
    out = _run(node_env, node_procs, tmp_path / "int8", ps_shards="all", compression="fixed:int8",
               lossy_warmup_steps=5, batch_handout="samples")
    for rank in (1, 2, 3):
        w = out[f"worker-{rank}"]
        assert w["ps"]["batch_handout"] == "samples"
        # int8 of a delta: its error is carried to the next pull; after the last pull the copy is within
        # half an int8 step of the last update's delta, far below the parameters' scale (about 0.1)
        assert w["ps"]["param_max_abs_diff"] < 1e-3, w["ps"]
        assert any("int8" in choices.get("gradients", {}) for choices in w["ps"]["push_policy"])
    assert out["coordinator"]["ps"]["shard"]["pull_policy"]["gradients"]["int8"] > 0
    assert out["coordinator"]["ps"]["partition_finest_bytes"] > 3 * 64 * 1024  # 64 KiB on the wire: int8 is 3.9x
    assert out["coordinator"]["test_accuracy"] > 0.5


def test_lossless_pulls_go_as_deltas_and_keep_the_workers_copy(tmp_path, node_env, node_procs):  # noqa: F811
    out = _run(node_env, node_procs, tmp_path / "zstd", ps_shards="all", compression="fixed:shuffle-zstd")
    pulls = out["coordinator"]["ps"]["shard"]["pull_policy"]
    assert list(pulls) == ["gradients"] and all("shuffle" in codec for codec in pulls["gradients"]), pulls
    for rank in (1, 2, 3):  # deltas added in float32 as the shard's replica adds them: rounding at most
        assert out[f"worker-{rank}"]["ps"]["param_max_abs_diff"] < 1e-6, out[f"worker-{rank}"]["ps"]
    assert out["coordinator"]["test_accuracy"] > 0.5


def test_a_sharded_run_that_loses_every_worker_fails_with_its_cause(tmp_path, node_env, node_procs):  # noqa: F811
    """One lost worker leaves the run going on (`test_worker_loss_sharded.py`); with none left it fails."""
    metrics_dir = tmp_path / "lost"
    fields = {**RUN, "metrics_dir": metrics_dir, "ps_shards": "all", "max_steps": 0, "duration_s": 60,
              "io_timeout_s": 5, "heartbeat_interval_s": 0.5}
    coord = node_procs.start("coordinator", node_env(node_id="coord", **fields))
    workers = [node_procs.start("worker", node_env(node_id=f"w{i}", **fields), name=f"worker-{i}") for i in (1, 2, 3)]
    marker = metrics_dir / "coordinator.training"
    deadline = time.monotonic() + 60
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(1.0)
    for w in workers:  # every worker hosts a shard
        w.kill()
    code = node_procs.wait(coord, 60)
    assert code == 4, node_procs.stderr(coord)[-2000:]
    c = json.loads((metrics_dir / "coordinator.json").read_text())
    assert c["status"] == "failed" and "sharded run" in c["error"] and "no surviving worker" in c["error"], c["error"]
    assert "lost worker" in c["error"], c["error"]  # names a worker that died
    assert sum(e["event"] == "worker_lost" for e in c["events"]) == 3


@pytest.mark.parametrize("piece_link_s, whole", [("1", True), ("0", False)])
def test_auto_pieces_per_shard_follow_the_probed_link(tmp_path, node_env, node_procs, piece_link_s,  # noqa: F811
                                                      whole):
    """``partitions_per_shard: auto`` (the default): the coordinator probes its link to each worker before
    the plan and cuts pieces of about ``piece_link_s`` on it. Loopback runs at Gbit/s: a second there is
    more than the 16 MiB cap (the digits 512-512 model's 0.2-0.4 MB ranges stay whole) and 0 is the
    finest pieces, 64 KiB and up (4-6 a shard)."""
    run = _run(node_env, node_procs, tmp_path / "auto", ps_shards="all", hidden_sizes="512,512",
               partition_bytes="4MiB", max_steps=3, piece_link_s=piece_link_s)
    ps = run["coordinator"]["ps"]
    assert ps["partitions_per_shard_setting"] == "auto" and ps["partitions_per_shard"] == 8
    probe = ps["link_probe"]
    assert sorted(probe["workers"]) == ["1", "2", "3"] and probe["probe_bytes"] == 1 << 20
    assert probe["piece_link_s"] == float(piece_link_s)
    assert all(w["rate_bps"] == min(w["down_bps"], w["up_bps"]) > 0 for w in probe["workers"].values())
    assert probe["rate_bps"] == min(w["rate_bps"] for w in probe["workers"].values())
    if whole:  # 16 MiB pieces and up: each shard's 0.2-0.4 MB range stays whole
        assert ps["partitions"] == 4 and ps["partition_finest_bytes"] == 16 << 20
    else:  # 64 KiB pieces and up: 4-6 a shard
        assert ps["partitions"] > 3 * 4 and ps["partition_finest_bytes"] == 64 * 1024
    assert run["coordinator"]["steps"] == run["worker-1"]["steps"] == 3


def test_central_and_sharded_with_gradient_accumulation_reach_the_same_parameters(tmp_path, node_env,  # noqa: F811
                                                                                   node_procs):
    """grad_accum_steps 3: each partition is pushed once, after the last micro-batch's backward."""
    central = _run(node_env, node_procs, tmp_path / "central", ps_shards=1, grad_accum_steps=3)
    sharded = _run(node_env, node_procs, tmp_path / "sharded", ps_shards="all", grad_accum_steps=3)
    c, s = central["coordinator"]["params_digest"], sharded["coordinator"]["params_digest"]
    assert central["coordinator"]["steps"] == sharded["coordinator"]["steps"] == 20
    for a, b in zip([c["sum"], c["l2"], *c["projections"]], [s["sum"], s["l2"], *s["projections"]]):
        assert math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-4), (c, s)
    assert sharded["worker-1"]["ps"]["param_max_abs_diff"] == 0.0


@pytest.mark.parametrize("model", [
    {"model": "transformer", "transformer_layers": 1, "transformer_width": 32, "transformer_heads": 2,
     "transformer_context": 32, "batch_size": 16},
    {"model": "embedding", "embedding_rows": 2000, "embedding_dim": 8, "embedding_fields": 3,
     "embedding_samples": 2000}], ids=["transformer", "embedding"])
def test_sharded_servers_train_every_dense_model(tmp_path, node_env, node_procs, model):  # noqa: F811
    nodes = _run(node_env, node_procs, tmp_path / "run", ps_shards="all", max_steps=40, momentum=0.9,
                 learning_rate=0.05, hidden_sizes="16", **model)
    coord = nodes["coordinator"]
    assert coord["steps"] == 40 and coord["ps"]["ps_shards"] == 4
    w1 = nodes["worker-1"]
    assert w1["loss_final"] < w1["loss_avg"], (w1["loss_final"], w1["loss_avg"])  # the loss falls
    assert math.isfinite(coord["test_loss"]) and coord["test_loss"] > 0  # the held-out metric
    if model["model"] == "transformer":
        assert math.isfinite(coord["validation_loss"]) and coord["validation_tokens"] > 0
    for rank in (1, 2, 3):
        assert nodes[f"worker-{rank}"]["ps"]["param_max_abs_diff"] == 0.0


def test_a_sharded_run_evaluates_snapshots_and_stops_at_its_target(tmp_path, node_env, node_procs):  # noqa: F811
    nodes = _run(node_env, node_procs, tmp_path / "run", ps_shards="all", max_steps=400, eval_every_s=0.2,
                 target_accuracy=0.8, stop_at_target=True)
    coord = nodes["coordinator"]
    held = coord["held_out"]
    assert coord["ps"]["snapshots"]["pulls"] >= 1 and coord["ps"]["snapshots"]["error"] is None
    assert len(held["curve"]) >= 2 and held["curve"][-1]["final"]
    assert coord["time_to_target_s"] is not None and coord["steps"] < 400  # it stopped at the target
    assert coord["test_accuracy"] >= 0.8
