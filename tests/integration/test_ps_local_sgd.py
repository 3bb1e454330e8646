"""Local SGD and DiLoCo on the sharded servers (`wiiide.server.ps.local_sgd`) on loopback: ``python -m wiiide``
subprocesses.

- with H, seed and fp32 fixed, central (ps_shards 1, `wiiide.server.pace.server`) and sharded (ps_shards all)
  local SGD reach the same parameters: bit for bit with two workers (the mean of two deltas is the same
  float32 sum in either order), for avg and Nesterov;
- sharded local SGD trains with avg, Nesterov and int8 outer steps both ways (loss falls, held-out
  accuracy reported) and every worker's copy ends on the shards' parameters.
"""

from __future__ import annotations

import pytest

from tests.integration.local_run import run_nodes
from tests.unit.conftest import free_port, node_env, node_procs  # noqa: F401  (fixtures)

RUN = {"num_workers": 2, "hidden_sizes": "64,64", "max_steps": 12, "duration_s": 120, "learning_rate": 0.1,
       "seed": 5, "partition_bytes": "8KiB", "local_steps": 4, "batch_size": 16}


@pytest.mark.parametrize("outer", [{"outer_optimizer": "avg"},
                                   {"outer_optimizer": "nesterov", "outer_learning_rate": 0.7}])
def test_central_and_sharded_local_sgd_reach_the_same_parameters(tmp_path, node_env, node_procs, outer):  # noqa: F811
    central = run_nodes(node_env, node_procs, tmp_path / "central", {**RUN, **outer, "ps_shards": 1})
    sharded = run_nodes(node_env, node_procs, tmp_path / "sharded", {**RUN, **outer, "ps_shards": "all"})
    c, s = central["coordinator"], sharded["coordinator"]
    assert c["steps"] == s["steps"] == 12  # outer steps
    assert c["batches"] == s["batches"] == 12 * 2 * 4 and c["samples"] == s["samples"] == 12 * 2 * 4 * 16
    assert s["ps"]["ps_shards"] == 3
    assert c["params_digest"]["sha256"] == s["params_digest"]["sha256"], (c["params_digest"], s["params_digest"])
    for rank in (1, 2):
        w = sharded[f"worker-{rank}"]
        assert w["ps"]["param_max_abs_diff"] == 0.0 and w["batches"] == 12 * 4  # fp32 pulls: the shards' copy
        assert w["ps"]["shard"]["updates"] == 12 * w["ps"]["shard"]["partitions"]


@pytest.mark.parametrize("variant", [
    {"outer_optimizer": "avg"}, {"outer_optimizer": "nesterov", "outer_learning_rate": 0.7},
    {"outer_optimizer": "avg", "compression": "fixed:int8", "lossy_warmup_steps": 0}],
    ids=["avg", "nesterov", "avg-int8"])
def test_sharded_local_sgd_trains(tmp_path, node_env, node_procs, variant):  # noqa: F811
    nodes = run_nodes(node_env, node_procs, tmp_path / "run", {
        **RUN, **variant, "num_workers": 3, "ps_shards": "all", "max_steps": 25, "eval_every_s": 0.5})
    coord = nodes["coordinator"]
    assert coord["steps"] == 25 and coord["ps"]["ps_shards"] == 4
    assert coord["test_accuracy"] > 0.8 and coord["held_out"]["curve"][-1]["final"]  # held-out, digits
    for rank in (1, 2, 3):
        w = nodes[f"worker-{rank}"]
        assert w["loss_final"] < w["loss_avg"] < 2.0, (w["loss_final"], w["loss_avg"])  # the loss falls
        gap = w["ps"]["param_max_abs_diff"]
        assert gap == 0.0 if "compression" not in variant else gap < 1e-3, gap  # int8: within the pull's residual
    if "compression" in variant:  # int8 both ways: the pushes' and the pulls' codec
        assert "int8" in str(nodes["worker-1"]["ps"]["push_policy"]) and "int8" in str(coord["ps"]["shard"]["pull_policy"])
