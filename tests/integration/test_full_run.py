"""A whole WIIIIIDE run on loopback: ``python -m wiiide`` coordinator and two workers as subprocesses,
200 steps (about 30 s on this machine, so not a unit test). Checks what every node's metrics file says
about the run it took part in.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from tests.unit.conftest import free_port, node_env, node_procs  # noqa: F401  (fixtures)


def read_json(path: Path) -> dict[str, Any]:
    assert path.exists(), f"missing {path}; folder holds {sorted(p.name for p in path.parent.glob('*'))}"
    return json.loads(path.read_text())


def test_full_run_coordinator_and_two_workers(tmp_path, node_env, node_procs):  # noqa: F811 (imported fixtures)
    metrics_dir = tmp_path / "metrics"
    coord = node_procs.start("coordinator", node_env(num_workers=2, node_id="coord"))
    workers = [node_procs.start("worker", node_env(node_id=f"w{i}"), name=f"worker-{i}") for i in (1, 2)]
    codes = [node_procs.wait(p, 120) for p in (coord, *workers)]
    assert codes == [0, 0, 0], [node_procs.stderr(p)[-2000:] for p in (coord, *workers)]

    c = read_json(metrics_dir / "coordinator.json")
    ws = {r: read_json(metrics_dir / f"worker-{r}.json") for r in (1, 2)}
    assert sorted(p.name for p in metrics_dir.glob("*.json")) == ["coordinator.json", "worker-1.json", "worker-2.json"]
    assert c["status"] == "ok" and c["role"] == "coordinator" and c["steps"] == 200
    assert c["workers_connected"] == 2
    per_worker = c["batches_per_worker"]
    assert set(per_worker) == {"1", "2"}
    assert sum(per_worker.values()) == c["batches"] == 400
    for rank, w in ws.items():
        assert w["status"] == "ok" and w["rank"] == rank
        assert w["batches"] == per_worker[str(rank)] == w["steps"] == 200
        assert w["samples"] == 200 * 32
        assert w["frames_sent"] >= 1 + 200  # hello + one gradient per step (+ heartbeats while idle)
        assert w["frames_received"] >= 2 + 2 * 200 + 1  # challenge, welcome, params + batch per step, stop
        assert w["loss_final"] is not None and math.isfinite(w["loss_final"])
    assert {w["node_id"] for w in ws.values()} == {"w1", "w2"}
    assert c["frames_sent"] >= 2 * 2 + 2 * 2 * 200 + 2  # challenges, welcomes, params + batches, stops
    assert c["frames_received"] >= 2 + 2 * 200  # hellos, gradients
    assert c["test_accuracy"] > 0.5
    assert c["test_loss"] < 1.0  # cross-entropy starts near ln(10) = 2.3
    assert c["loss_final"] < c["loss_avg"]  # the training loss went down
    assert len(c["socket_options"]) == 2 and all(o["tcp_nodelay"] for o in c["socket_options"])
    assert [e["event"] for e in c["events"]].count("worker_joined") == 2
