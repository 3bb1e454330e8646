"""A learning-rate schedule applied where the optimizer lives, on loopback (``python -m wiiide`` subprocesses):
the central server, every shard of ``ps_shards: all``, and the pace server's local SGD record the rate of
every step they took, and it is the schedule's (warm-up from 0, then cosine down to the floor)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.local_run import run_nodes
from tests.unit.conftest import free_port, node_env, node_procs  # noqa: F401  (fixtures)

STEPS = 12
RUN = {"num_workers": 2, "hidden_sizes": "32", "max_steps": STEPS, "duration_s": 120, "learning_rate": 0.2,
       "seed": 1, "partition_bytes": "2KiB", "lr_schedule": "cosine", "lr_warmup_steps": 4, "lr_min_ratio": 0.25}
# the schedule's rates, hand-computed: t/4 x 0.2 for t < 4, then 0.2 x (0.25 + 0.75 (1 + cos(pi (t-4)/8)) / 2)
EXPECTED = [0.0, 0.05, 0.1, 0.15, 0.2, 0.194291, 0.178033, 0.153701, 0.125, 0.096299, 0.071967, 0.055709]


def _run(node_env, node_procs, metrics_dir: Path, **fields) -> dict:  # noqa: F811
    return run_nodes(node_env, node_procs, metrics_dir, {**RUN, **fields})


def test_central_server_applies_the_scheduled_rate(tmp_path, node_env, node_procs):  # noqa: F811
    coord = _run(node_env, node_procs, tmp_path / "central", ps_shards="1")["coordinator"]
    assert coord["steps"] == STEPS
    assert coord["lr_per_step"] == pytest.approx(EXPECTED, abs=1e-6)
    assert coord["lr_schedule"]["kind"] == "cosine" and coord["lr_schedule"]["decay_steps"] == STEPS - 4


def test_every_shard_applies_the_scheduled_rate(tmp_path, node_env, node_procs):  # noqa: F811
    nodes = _run(node_env, node_procs, tmp_path / "sharded", ps_shards="all")
    shards = [node["ps"]["shard"] for node in nodes.values() if "shard" in node.get("ps", {})]
    assert len(shards) == 3  # the coordinator's and each worker's
    for shard in shards:
        assert shard["updates"] >= STEPS and shard["lr_per_step"] == pytest.approx(EXPECTED, abs=1e-6), shard


def test_local_sgd_workers_take_the_inner_rate_of_their_task(tmp_path, node_env, node_procs):  # noqa: F811
    coord = _run(node_env, node_procs, tmp_path / "local_sgd", local_steps=2, ps_shards="1")["coordinator"]
    assert coord["lr_applied_by"] == "worker inner steps"
    assert coord["lr_per_step"] == pytest.approx(EXPECTED, abs=1e-6)


@pytest.mark.parametrize("engine", ["ddp", "fsdp"])
def test_every_torch_rank_applies_the_scheduled_rate(tmp_path, node_env, node_procs, engine):  # noqa: F811
    nodes = _run(node_env, node_procs, tmp_path / engine, engine=engine)
    assert len(nodes) == 3  # world size: the coordinator (rank 0) and 2 workers
    for name, node in nodes.items():
        assert node["steps"] == STEPS and node["lr_per_step"] == pytest.approx(EXPECTED, abs=1e-6), name
