"""Sparse embedding rows under the central pace server (``ps_shards: 1``, ``sparse_embedding: true`` with a
staleness bound, async, local SGD or adaptive batches; `wiiide.server.pace.rows`) on loopback, ``python -m
wiiide`` subprocesses:

- a lone worker at its own pace sees every update before its next task, so its run must reach the
  synchronous server's parameters to the bit: a changed row left out of a pull would make the worker
  compute on an old row and the parameters part;
- central and sharded local SGD on rows from one seed reach the same parameters (the same sums in the
  same order: `wiiide.server.sparse.sum_rows` in rank order, rate 1);
- under a bound (with the SSP cache) and with adaptive batches the run trains and each pull carries the
  changed rows, not the table.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.local_run import run_nodes
from tests.unit.conftest import free_port, node_env, node_procs  # noqa: F401  (fixtures)

RUN = {"model": "embedding", "sparse_embedding": True, "embedding_rows": 1000, "embedding_fields": 4,
       "embedding_samples": 4000, "num_workers": 2, "batch_size": 32, "max_steps": 60, "duration_s": 120,
       "momentum": 0.0, "learning_rate": 0.5, "seed": 5, "partition_bytes": "8KiB", "partitions_per_shard": 1,
       "ps_shards": 1}
TABLE_BYTES = 1000 * 16 * 4  # embedding_rows x embedding_dim (default 16) float32


def _run(node_env, node_procs, metrics_dir: Path, **fields) -> dict:  # noqa: F811
    return run_nodes(node_env, node_procs, metrics_dir, {**RUN, **fields})


def test_a_lone_worker_at_its_own_pace_on_rows_reaches_the_synchronous_parameters(tmp_path, node_env, node_procs):  # noqa: F811
    rounds = _run(node_env, node_procs, tmp_path / "sync", num_workers=1)["coordinator"]
    for label, pacing in (("async", {"staleness_bound": "async"}), ("ssp-2", {"staleness_bound": 2})):
        paced = _run(node_env, node_procs, tmp_path / label, num_workers=1, **pacing)["coordinator"]
        assert paced["steps"] == rounds["steps"] == 60 and paced["pace"]["staleness_bound"] == pacing["staleness_bound"]
        assert paced["params_digest"]["sha256"] == rounds["params_digest"]["sha256"], label
        assert paced["staleness_histogram"] == {"0": 60}
        rows = paced["pace"]["sparse_rows"]  # the first task in full, then the rows each update moved
        assert rows["pulls_full"] == 1 and rows["pulls_rows"] == 59
        assert 0 < rows["rows_per_pull"] < 0.5 * 1000
    assert rounds["test_loss"] < rounds["loss_first"]


def test_central_and_sharded_local_sgd_on_rows_reach_the_same_parameters(tmp_path, node_env, node_procs):  # noqa: F811
    local = {"local_steps": 4, "max_steps": 40}
    central = _run(node_env, node_procs, tmp_path / "central", **local)["coordinator"]
    sharded = _run(node_env, node_procs, tmp_path / "sharded", **local, ps_shards="all")["coordinator"]
    assert central["steps"] == sharded["steps"] == 40 and central["batches"] == 40 * 2 * 4
    assert central["pace"]["local_steps"] == 4 and sharded["ps"]["ps_shards"] == 3
    assert central["params_digest"]["sha256"] == sharded["params_digest"]["sha256"]
    assert central["test_loss"] < 0.8 * central["loss_first"]
    assert central["pace"]["sparse_rows"]["pulls_full"] == 2  # one per worker, then rows


def test_central_sparse_rows_train_under_a_bound_with_the_ssp_cache_and_with_adaptive_batches(
        tmp_path, node_env, node_procs):  # noqa: F811
    # one worker slowed so that the bound binds and the cache has fresh copies to keep
    slow = {"debug_step_sleep_s": 0.02, "debug_sleep_worker_rank": 1}
    bound = _run(node_env, node_procs, tmp_path / "ssp-2", num_workers=3, staleness_bound=2, ssp_cache=True,
                 max_steps=600, learning_rate=0.2, **slow)
    c = bound["coordinator"]
    assert c["steps"] == 600 and c["test_loss"] < 0.9 * c["loss_first"] and c["test_accuracy"] > 0.65
    assert c["clock_gap_max"] <= 3 and c["pace"]["tasks_without_params"] > 0  # the cache answered some tasks
    rows = c["pace"]["sparse_rows"]
    assert rows["pulls_full"] == 3 and rows["pulls_rows"] + 3 == c["pace"]["tasks_with_params"]
    assert c["wire_bytes_sent"] < 0.5 * c["pace"]["tasks_with_params"] * TABLE_BYTES  # rows, not the table
    rounds = _run(node_env, node_procs, tmp_path / "adaptive", num_workers=3, adaptive_batch=True, max_steps=200, **slow)
    r = rounds["coordinator"]
    assert r["steps"] == 200 and r["test_loss"] < r["loss_first"] and r["test_accuracy"] > 0.65
    last = {rank: points[-1][1] for rank, points in r["batch_sizes_per_worker"].items()}
    assert sum(last.values()) == 3 * 32 and last["1"] < last["2"]  # the slow worker's share shrank


def test_the_expected_bytes_of_an_async_update_on_rows_are_what_the_server_moves(tmp_path, node_env, node_procs):  # noqa: F811
    # an update is one worker's push and its pull, which carries the rows of about one push of every worker
    # (`wiiide.server.sparse.expected_bytes_per_step`); the first pull of each worker is the whole table
    c = _run(node_env, node_procs, tmp_path / "async", num_workers=3, staleness_bound="async", max_steps=300)["coordinator"]
    expected, updates, rows = c["comm"]["expected"], c["steps"], c["pace"]["sparse_rows"]
    assert updates == 300 and rows["pulls_full"] == 3
    assert c["payload_bytes_received"] / updates == pytest.approx(expected["push_bytes"], rel=0.05)
    row_pulls_bytes = c["payload_bytes_sent"] - rows["pulls_full"] * expected["param_bytes"]
    assert row_pulls_bytes / rows["pulls_rows"] == pytest.approx(expected["pull_bytes"], rel=0.08)
    moved_bytes = c["payload_bytes_received"] + row_pulls_bytes  # the run's pushes and row pulls, per update
    assert moved_bytes / updates == pytest.approx(expected["total_bytes"], rel=0.08)
