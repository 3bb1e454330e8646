"""A coordinator killed mid-run and restarted on the local backend: it restores its newest checkpoint,
the workers rejoin (retrying for rejoin_timeout_s) and the run completes; the steps lost are at most
checkpoint_every_steps and recorded with the recovery time in the coordinator's metrics."""

from __future__ import annotations

import json
import time

from tests.integration.local_run import run_local, wait_for
from wiiide.config import RunConfig

EVERY_STEPS = 20
MAX_STEPS = 600


def test_coordinator_killed_and_restarted_resumes_from_its_checkpoint(tmp_path):
    cfg = RunConfig(dataset="digits", num_workers=2, log_tier="normal", log_every_steps=100000, io_timeout_s=10.0,
                    heartbeat_interval_s=1.0, connect_timeout_s=30, duration_s=120, max_steps=MAX_STEPS,
                    checkpoint_every_steps=EVERY_STEPS, rejoin_timeout_s=30, momentum=0.5,
                    ps_shards="1")  # the central server's checkpoints (sharded: test_recovery_sharded.py)
    ckpt_dir = tmp_path / "checkpoints"
    seen = {}

    def kill_and_restart(controller):
        # kill as soon as the second checkpoint is on disk, well before max_steps
        wait_for(lambda: len(list(ckpt_dir.glob("coordinator-step*.safetensors"))) >= 2, 60, "two checkpoints")
        controller.kill("coordinator")
        seen["killed_unix_s"] = time.time()
        seen["newest"] = max(int(p.name[16:28]) for p in ckpt_dir.glob("coordinator-step*.safetensors"))
        seen["restarted_unix_s"] = time.time()
        controller.restart("coordinator")

    start_unix_s = time.time()
    nodes = run_local(cfg, tmp_path, kill_and_restart)
    newest_on_disk = seen["newest"]
    coord = nodes["coordinator"]
    assert coord["steps"] == MAX_STEPS and coord["test_accuracy"] > 0.5
    rec = coord["recovery"]
    assert rec["incarnation"] == 2 and rec["refused"] == []
    k = rec["steps_at_crash"]  # the step the killed coordinator had reached
    assert rec["restored_step"] == newest_on_disk <= k < MAX_STEPS
    assert rec["restored_step"] % EVERY_STEPS == 0
    assert 0 <= rec["steps_lost"] == k - rec["restored_step"] <= EVERY_STEPS
    assert rec["workers_rejoined"] == 2
    # the recovery runs from the workers' last parameters from the killed coordinator (before it was killed,
    # give or take a frame read from a socket buffer) to the restarted one's first step
    last_seen_unix_s = rec["first_step_unix_s"] - rec["recovery_s"]
    assert start_unix_s < last_seen_unix_s <= seen["killed_unix_s"] + 1.0
    assert rec["first_step_unix_s"] > seen["restarted_unix_s"]
    # the restarted process's part of it: it started after the kill (to a clock tick)
    assert 0 < rec["process_start_to_first_step_s"] <= rec["recovery_s"] + 0.1
    # this incarnation trained the remaining steps only (both workers, barring a drop on a loaded machine)
    remaining = MAX_STEPS - rec["restored_step"]
    assert remaining <= sum(coord["batches_per_worker"].values()) <= 2 * remaining
    starts = (tmp_path / "nodes" / "coordinator.starts.jsonl").read_text().splitlines()
    assert [json.loads(line)["incarnation"] for line in starts] == [1, 2]
    for name in ("worker-1", "worker-2"):
        assert any(e["event"] == "coordinator_lost" for e in nodes[name]["events"])
