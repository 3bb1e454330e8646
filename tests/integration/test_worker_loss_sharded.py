"""A worker killed mid-run under ps_shards all (3 workers: the coordinator and every worker host a
shard) on the local backend: the run goes on with the two that remain, the lost shard's partitions
re-planned over the surviving nodes from a surviving worker's copy of the parameters
(wiiide.server.ps.membership), and after the recovery every shard's parameters and every worker's copy have
the same digest."""

from __future__ import annotations

from harness.results.report import load_report_json as load_report
from harness.spec.points import build_spec
from harness.sweep import run_sweep

BASE = {"dataset": "digits", "num_workers": 3, "ps_shards": "all", "log_tier": "normal", "log_every_steps": 100000,
        "io_timeout_s": 5.0, "heartbeat_interval_s": 0.5, "connect_timeout_s": 30, "momentum": 0.5,
        "partition_bytes": "4KiB", "duration_s": 8}


def _recovery_timed(coord: dict, rec: dict) -> None:
    """The recovery's seconds run from the loss noticed to the new incarnation's first step: they hold the
    gathering of the state (``state_s``), and the ``ps_recovered`` event reports the same figure. (How
    long it takes is a benchmark's: `experiments/worker-loss-sharded.yaml`, not a test's.)"""
    assert rec["state_s"] <= rec["recovery_s"]
    [event] = [e for e in coord["events"] if e["event"] == "ps_recovered" and e["incarnation"] == rec["incarnation"]]
    assert event["recovery_s"] == rec["recovery_s"] and event["step"] == rec["first_step"]

def test_a_worker_killed_mid_run_under_ps_shards_all_leaves_the_run_going_on_the_survivors(tmp_path):
    spec = build_spec({"name": "ps-worker-kill", "base": BASE,
                       "faults": [{"action": "kill", "target": "worker-2", "at_s": 2}]}, "kill.yaml")
    report = load_report(run_sweep(spec, "local", tmp_path, progress=lambda line: None))
    rep = report["points"][0]["repeats"][0]
    assert rep["status"] == "ok", rep["error"]
    coord = rep["nodes"]["coordinator"]
    [rec] = coord["ps"]["recoveries"]
    ranks = {e["node_id"]: e["rank"] for e in coord["events"] if e["event"] == "worker_joined"}
    killed = ranks["local-worker-2"]  # ranks go by join order
    alive = sorted(set(ranks.values()) - {killed})
    assert rec["lost"] == [killed] and rec["workers"] == alive and rec["ps_shards"] == 3 and rec["incarnation"] == 2
    assert rec["digests_equal"] is True and rec["copies_equal"] is True
    digests = rec["digests"]
    assert set(digests["workers"]) == {str(r) for r in alive} and len(digests["shards"]["shards"]) == 3
    assert all(d == digests["shards"] for d in digests["workers"].values())
    assert digests["shards"]["sha256"] == rec["params_sha256"]
    assert 0 <= rec["steps_lost"] <= 2 and rec["first_step"] == rec["step"] + 1
    _recovery_timed(coord, rec)
    assert coord["steps"] > rec["first_step"]  # trained on after the recovery
    counts = coord["batches_per_worker"]  # a survivor's step done before the loss was noticed is counted, then redone
    assert all(coord["steps"] <= counts[str(r)] <= coord["steps"] + 1 for r in alive)
    assert rec["step"] <= counts[str(killed)] <= rec["step"] + 1 < coord["steps"]
    kept, total = map(int, rec["momentum_partitions_kept"].split("/"))
    assert kept < total and (kept > 0 or rec["step"] <= 1)  # the survivors' shards kept theirs (none before step 1)
    assert coord["ps"]["incarnation"] == 2 and coord["ps"]["ps_shards"] == 3
    assert rep["totals"]["test_accuracy"] > 0.5
    survivors = [n for n in rep["nodes"].values() if n.get("rank") in alive]
    assert len(survivors) == 2 and all(n["ps"]["param_max_abs_diff"] == 0.0 for n in survivors)  # copies = shards


def test_a_killed_worker_that_comes_back_is_readmitted_at_the_next_round(tmp_path):
    # long enough for the restarted process to start (torch import) and rejoin on a loaded machine
    spec = build_spec({"name": "ps-worker-kill-restart", "base": {**BASE, "duration_s": 25},
                       "faults": [{"action": "kill", "target": "worker-2", "at_s": 2},
                                  {"action": "restart", "target": "worker-2", "at_s": 3}]}, "kill.yaml")
    report = load_report(run_sweep(spec, "local", tmp_path, progress=lambda line: None))
    rep = report["points"][0]["repeats"][0]
    assert rep["status"] == "ok", rep["error"]
    coord = rep["nodes"]["coordinator"]
    lost, back = coord["ps"]["recoveries"]
    killed = lost["lost"][0]
    assert lost["rejoined"] == [] and back["lost"] == [] and back["rejoined"] == [killed]
    assert back["workers"] == [1, 2, 3] and back["ps_shards"] == 4 and back["incarnation"] == 3
    assert back["steps_lost"] == 0 and back["digests_equal"] is True and set(back["digests"]["workers"]) == {"1", "2", "3"}
    assert back["momentum_partitions_kept"].split("/")[0] == back["momentum_partitions_kept"].split("/")[1]
    assert any(e["event"] == "worker_rejoined" and e["rank"] == killed for e in coord["events"])
    counts = coord["batches_per_worker"]  # the killed rank trained before its loss and after its return
    assert lost["step"] <= counts[str(killed)] - (coord["steps"] - back["step"]) <= lost["step"] + 1
    assert coord["steps"] > back["first_step"] and rep["totals"]["test_accuracy"] > 0.5
    finished = [n for n in rep["nodes"].values() if n.get("role") == "worker" and n.get("status") == "ok"]
    assert len(finished) == 3 and all(n["ps"]["param_max_abs_diff"] == 0.0 for n in finished)  # the returned one too


def test_a_worker_killed_under_async_or_a_bound_restarts_from_the_surviving_shards_and_the_newest_copies(tmp_path):
    spec = build_spec({"name": "ps-worker-kill-paced", "base": BASE,
                       "axes": {"staleness_bound": ["async", 2]},
                       "faults": [{"action": "kill", "target": "worker-2", "at_s": 2}]}, "kill.yaml")
    report = load_report(run_sweep(spec, "local", tmp_path, progress=lambda line: None))
    for point in report["points"]:
        rep = point["repeats"][0]
        assert rep["status"] == "ok", (point["params"], rep["error"])
        coord = rep["nodes"]["coordinator"]
        [rec] = coord["ps"]["recoveries"]
        ranks = {e["node_id"]: e["rank"] for e in coord["events"] if e["event"] == "worker_joined"}
        killed = ranks["local-worker-2"]
        alive = sorted(set(ranks.values()) - {killed})
        assert rec["lost"] == [killed] and rec["workers"] == alive and rec["ps_shards"] == 3
        assert rec["source"] == "the surviving shards and the newest copies" and rec["copies_equal"] is None
        # the lost shard's partitions came from a survivor's copy; the others from their shards, momentum too
        lost_parts, kept = rec["partitions"]["from_copies"], rec["partitions"]["from_shards"]
        assert lost_parts and kept >= 2  # the coordinator's shard and the other survivor's
        assert all(c["rank"] in alive and c["version"] >= 0 for c in lost_parts.values())
        assert rec["momentum_partitions_kept"] == f"{kept}/{kept + len(lost_parts)}"
        assert rec["digests_equal"] is True
        _recovery_timed(coord, rec)
        assert 0 <= rec["steps_lost"] <= 2 * 3  # at most TASKS_AHEAD + 1 tasks in flight per worker
        assert coord["steps"] > rec["first_step"] > rec["step"]  # trained on after the recovery
        assert rep["totals"]["test_accuracy"] > 0.5
