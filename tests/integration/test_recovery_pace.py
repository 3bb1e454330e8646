"""A coordinator running at the workers' pace (staleness bound 2, local SGD with H = 4 and DiLoCo's
Nesterov outer step) killed mid-run and restarted on the local backend: it restores its newest
checkpoint (parameters, the outer optimizer's momentum, the version), the workers rejoin and the run
completes."""

from __future__ import annotations

import json

from tests.integration.local_run import run_local, wait_for
from wiiide.config import RunConfig

EVERY_STEPS = 10
MAX_STEPS = 120


def test_pace_coordinator_killed_and_restarted_resumes_from_its_checkpoint(tmp_path):
    cfg = RunConfig(dataset="digits", num_workers=2, log_tier="normal", log_every_steps=100000, io_timeout_s=10.0,
                    heartbeat_interval_s=1.0, connect_timeout_s=30, duration_s=120, max_steps=MAX_STEPS,
                    checkpoint_every_steps=EVERY_STEPS, rejoin_timeout_s=30, staleness_bound=2, local_steps=4,
                    outer_optimizer="nesterov", learning_rate=0.05, ps_shards="1")  # the central pace server
    ckpt_dir = tmp_path / "checkpoints"
    seen = {}

    def kill_and_restart(controller):
        wait_for(lambda: len(list(ckpt_dir.glob("coordinator-step*.safetensors"))) >= 2, 60, "two checkpoints")
        controller.kill("coordinator")
        seen["newest"] = max(int(p.name[16:28]) for p in ckpt_dir.glob("coordinator-step*.safetensors"))
        controller.restart("coordinator")

    nodes = run_local(cfg, tmp_path, kill_and_restart)
    coord = nodes["coordinator"]
    # under a staleness bound the pushes read in one pass are all applied: max_steps + 1 at most
    assert MAX_STEPS <= coord["steps"] <= MAX_STEPS + 1 and coord["test_accuracy"] > 0.5
    rec = coord["recovery"]
    assert rec["incarnation"] == 2 and rec["refused"] == []
    assert rec["restored_step"] == seen["newest"] and rec["restored_step"] % EVERY_STEPS == 0
    assert 0 < rec["restored_step"] < MAX_STEPS and coord["pace"]["restored_step"] == rec["restored_step"]
    assert rec["workers_rejoined"] == 2 and rec["tasks_lost"] >= 0 and "steps_lost" not in rec
    # this incarnation applied the remaining updates only: 4 local steps a push, one push an update
    assert sum(coord["pushes_per_worker"].values()) == coord["steps"] - rec["restored_step"]
    starts = (tmp_path / "nodes" / "coordinator.starts.jsonl").read_text().splitlines()
    assert [json.loads(line)["incarnation"] for line in starts] == [1, 2]
    for name in ("worker-1", "worker-2"):
        assert any(e["event"] == "coordinator_lost" for e in nodes[name]["events"])
