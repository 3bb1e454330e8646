"""bench-handshake end to end on loopback, at a tiny size: a flood run and its unattacked twin side by
side, real coordinator and worker processes, the attacker as its subprocess. Checks that both runs
train with the probe admitted and answering every step, and that the attack reached the coordinator
and was refused; no figure of the benchmark is asserted."""

from __future__ import annotations

import json

from harness.bench.handshake import run_bench
from wiiide.config import RunConfig


def test_a_flood_run_and_its_twin_train_with_the_probe_admitted(tmp_path):
    params = {"scenarios": ["flood"], "repeats": 1, "duration_s": 2.0, "handshake_timeout_s": 1.0,
              "slowloris_connections": 10, "flood_connections": 40}
    data = json.loads(run_bench(params, tmp_path, lambda line: None).read_text())
    runs = {r["scenario"]: r for r in data["runs"]}
    assert sorted(runs) == ["flood", "none"]
    for name, run in runs.items():
        assert "error" not in run and run["status"] == "ok", (name, run.get("error"))
        assert run["coordinator_exit"] == 0 and run["worker_exit"] == 0, name
        assert run["attempts"] >= 1, name
        assert run["probe_steps"] == run["steps"], name  # the probe answered every round
        assert run["samples"] == run["steps"] * 2 * RunConfig().batch_size, name  # two workers a round
    assert "attacker" not in runs["none"] and runs["none"]["refused"] == 0
    attacker = runs["flood"]["attacker"]
    assert attacker["opened"] >= params["flood_connections"] and attacker["closed_by_peer"] >= 1
    assert runs["flood"]["refused"] >= 1  # the coordinator refused the attacker's connections
    assert set(data["summary"]) == {"none", "flood"} and data["summary"]["flood"]["runs"] == 1
