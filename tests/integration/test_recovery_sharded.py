"""A sharded run (ps_shards all: the coordinator and both workers host a shard) whose coordinator is
killed mid-run and restarted on the local backend: the workers notice the lost coordinator, rejoin the
restarted one, and the whole sharded run restarts from the newest step whose checkpoint is complete and
verified on every shard (wiiide.server.ps.checkpoints); the restored parameters are bit for bit those of an
uninterrupted run at that step, the steps lost are fewer than checkpoint_every_steps, and the run
completes."""

from __future__ import annotations

import json
import re
import time

from tests.integration.local_run import run_local, wait_for
from wiiide.config import RunConfig

EVERY_STEPS = 20
MAX_STEPS = 300
SHARDS = 3  # the coordinator + 2 workers
FILE = re.compile(r"^ps-shard-(\d+)-step(\d{12})\.safetensors$")


def _complete_steps(ckpt_dir) -> list[int]:
    """Steps every shard has a file for (unverified)."""
    by_shard: dict[int, set[int]] = {}
    for path in ckpt_dir.glob("ps-shard-*.safetensors") if ckpt_dir.is_dir() else []:
        m = FILE.match(path.name)
        if m:
            by_shard.setdefault(int(m.group(1)), set()).add(int(m.group(2)))
    if len(by_shard) < SHARDS:
        return []
    return sorted(set.intersection(*by_shard.values()))


def test_sharded_coordinator_killed_and_restarted_resumes_from_the_newest_complete_step(tmp_path):
    knobs = dict(dataset="digits", num_workers=2, ps_shards="all", log_tier="normal", log_every_steps=100000,
                 io_timeout_s=10.0, heartbeat_interval_s=1.0, connect_timeout_s=30, duration_s=120,
                 checkpoint_every_steps=EVERY_STEPS, rejoin_timeout_s=30, momentum=0.5, partition_bytes="4KiB")
    ckpt_dir = tmp_path / "faulted" / "checkpoints"
    seen: dict = {}

    def kill_and_restart(controller):
        # kill once two steps are complete on every shard, well before max_steps
        wait_for(lambda: len(_complete_steps(ckpt_dir)) >= 2, 60, "two complete sharded checkpoints")
        controller.kill("coordinator")
        seen["killed_unix_s"] = time.time()
        seen["complete_at_kill"] = max(_complete_steps(ckpt_dir))
        seen["restarted_unix_s"] = time.time()
        controller.restart("coordinator")

    start_unix_s = time.time()
    nodes = run_local(RunConfig(**knobs, max_steps=MAX_STEPS), tmp_path / "faulted", kill_and_restart)
    coord = nodes["coordinator"]
    assert coord["steps"] == MAX_STEPS and coord["test_accuracy"] > 0.5
    rec = coord["recovery"]
    assert rec["incarnation"] == 2 and rec["refused"] == []
    assert rec["restored_shards"] == SHARDS and len(rec["restored_files"]) == SHARDS
    k = rec["steps_at_crash"]  # the step the workers had reached when the coordinator died
    assert rec["restored_step"] % EVERY_STEPS == 0 and seen["complete_at_kill"] <= rec["restored_step"] <= k < MAX_STEPS
    # a step the workers finished is on disk on every shard (a shard writes before it answers the pulls)
    assert 0 <= rec["steps_lost"] == k - rec["restored_step"] < EVERY_STEPS
    assert rec["workers_rejoined"] == 2
    # the recovery runs from the workers' last parameters from the killed coordinator (before it was killed,
    # give or take a frame read from a socket buffer) to the restarted one's first step
    last_seen_unix_s = rec["first_step_unix_s"] - rec["recovery_s"]
    assert start_unix_s < last_seen_unix_s <= seen["killed_unix_s"] + 1.0
    assert rec["first_step_unix_s"] > seen["restarted_unix_s"]
    # the restarted process's part of it: it started after the kill (to a clock tick)
    assert 0 < rec["process_start_to_first_step_s"] <= rec["recovery_s"] + 0.1
    assert sum(coord["batches_per_worker"].values()) == 2 * (MAX_STEPS - rec["restored_step"])
    starts = (tmp_path / "faulted" / "nodes" / "coordinator.starts.jsonl").read_text().splitlines()
    assert [json.loads(line)["incarnation"] for line in starts] == [1, 2]
    for name in ("worker-1", "worker-2"):
        assert any(e["event"] == "coordinator_lost" for e in nodes[name]["events"])
        assert nodes[name]["ps"]["param_max_abs_diff"] == 0.0  # the rejoined workers' copy is the shards'

    # an uninterrupted run of restored_step steps ends with exactly the parameters restored
    plain = run_local(RunConfig(**{**knobs, "checkpoint_every_steps": 0}, max_steps=rec["restored_step"]),
                 tmp_path / "plain")
    assert plain["coordinator"]["steps"] == rec["restored_step"]
    assert plain["coordinator"]["params_digest"]["sha256"] == rec["restored_params_sha256"]
