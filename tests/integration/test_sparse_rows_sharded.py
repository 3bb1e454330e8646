"""Sparse embedding rows on the sharded servers (``ps_shards: all``, ``sparse_embedding: true``) on
loopback, ``python -m wiiide`` subprocesses: the run trains (loss falls), every worker's copy equals the
shards' parameters, and from one seed in fp32 it reaches the parameters of the central server's sparse
run (the same sums in the same order: `wiiide.server.sparse.sum_rows` per row partition, rank order for the
MLP's)."""

from __future__ import annotations

import math
from pathlib import Path

from tests.integration.local_run import run_nodes
from tests.unit.conftest import free_port, node_env, node_procs  # noqa: F401  (fixtures)

RUN = {"model": "embedding", "sparse_embedding": True, "embedding_rows": 1000, "embedding_fields": 4,
       "embedding_samples": 4000, "num_workers": 3, "batch_size": 32, "max_steps": 100, "duration_s": 120,
       "momentum": 0.0, "learning_rate": 2.0, "seed": 5, "partition_bytes": "8KiB", "partitions_per_shard": 1}


def _run(node_env, node_procs, metrics_dir: Path, **fields) -> dict:  # noqa: F811
    return run_nodes(node_env, node_procs, metrics_dir, {**RUN, **fields})


def test_sharded_sparse_rows_train_and_match_the_central_sparse_server(tmp_path, node_env, node_procs):  # noqa: F811
    central = _run(node_env, node_procs, tmp_path / "central", ps_shards=1)
    sharded = _run(node_env, node_procs, tmp_path / "sharded", ps_shards="all")
    c, s = central["coordinator"], sharded["coordinator"]
    assert c["steps"] == s["steps"] == 100
    assert s["loss_final"] < 0.8 * s["loss_avg"] and s["test_accuracy"] > 0.7  # it learns
    # the same sums in the same order on both placements: the same bits
    assert s["params_digest"]["sha256"] == c["params_digest"]["sha256"], (c["params_digest"], s["params_digest"])
    assert s["loss_final"] == c["loss_final"]
    ps = s["ps"]  # the 64 KB table: one row partition per shard, then the MLP's in 8 KiB pieces
    assert ps["ps_shards"] == 4 and ps["partitions"] >= 4 + 2 and min(ps["shard_loads_bytes"]) > 0
    for rank in (1, 2, 3):
        worker = sharded[f"worker-{rank}"]
        assert worker["ps"]["param_max_abs_diff"] == 0.0  # the worker's copy is the shards' to the bit
        assert worker["ps"]["shard"]["updates"] == 100 * worker["ps"]["shard"]["partitions"]


def test_sharded_sparse_rows_under_async_pull_every_changed_row_so_a_lone_workers_copy_stays_exact(
        tmp_path, node_env, node_procs):  # noqa: F811
    # one worker: after each pull its copy must be the shards' to the bit, or a changed row was left out
    run = _run(node_env, node_procs, tmp_path / "async-1", ps_shards="all", num_workers=1, staleness_bound="async",
               max_steps=60)
    coord, worker = run["coordinator"], run["worker-1"]
    assert coord["steps"] == 60 and coord["pace"]["placement"] == "sharded"
    assert worker["ps"]["param_max_abs_diff"] == 0.0
    assert coord["loss_final"] < coord["loss_first"]


def test_sharded_sparse_rows_train_under_a_bound_and_with_adaptive_batches(tmp_path, node_env, node_procs):  # noqa: F811
    # each push is one step of one worker's batch: the rounds' rate 2.0 diverges here, dense rows too;
    # at 0.5 it trains or not from run to run, dense rows too (0.44-0.60 held-out loss after 300 updates)
    bound = _run(node_env, node_procs, tmp_path / "ssp-2", ps_shards="all", staleness_bound=2, max_steps=600,
                 learning_rate=0.2)
    c = bound["coordinator"]
    assert c["steps"] == 600 and c["test_loss"] < 0.9 * c["loss_first"] and c["test_accuracy"] > 0.65
    table_bytes = 1000 * RUN.get("embedding_dim", 16) * 4
    for rank in (1, 2, 3):  # each pull is the rows changed since the worker's last, not the table
        shard = bound[f"worker-{rank}"]["ps"]["shard"]
        assert shard["link_wire_bytes"]["pulls_sent"] < 0.5 * shard["updates"] * table_bytes / shard["partitions"]
    rounds = _run(node_env, node_procs, tmp_path / "adaptive", ps_shards="all", adaptive_batch=True, learning_rate=0.5,
                  max_steps=200)
    r = rounds["coordinator"]
    assert r["steps"] == 200 and r["test_loss"] < r["loss_first"] and r["test_accuracy"] > 0.65
    for rank in (1, 2, 3):  # rounds: every worker gets the same weighted rows, so every copy is the shards'
        assert rounds[f"worker-{rank}"]["ps"]["param_max_abs_diff"] == 0.0


def test_sharded_sparse_local_sgd_pushes_the_touched_rows_delta_and_keeps_every_copy_exact(
        tmp_path, node_env, node_procs):  # noqa: F811
    rounds = _run(node_env, node_procs, tmp_path / "local-4", ps_shards="all", local_steps=4, max_steps=40,
                  learning_rate=0.5)
    c = rounds["coordinator"]
    assert c["steps"] == 40 and c["test_loss"] < 0.8 * c["loss_first"] and c["test_accuracy"] > 0.7
    for rank in (1, 2, 3):  # the shards' outer step on the rows is the workers' sgd_rows at rate 1: the same bits
        assert rounds[f"worker-{rank}"]["ps"]["param_max_abs_diff"] == 0.0
    lone = _run(node_env, node_procs, tmp_path / "local-4-async", ps_shards="all", num_workers=1, local_steps=4,
                staleness_bound="async", max_steps=30, learning_rate=0.5)
    assert lone["worker-1"]["ps"]["param_max_abs_diff"] == 0.0  # the changed rows pulled back, every one
    assert lone["coordinator"]["test_loss"] < lone["coordinator"]["loss_first"]
