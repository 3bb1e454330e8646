"""Docker test: `status --once` on a real 1 + 1 cluster lists the coordinator and the worker with a
step count, then `down` leaves nothing of the project.

Runs the CLI as a user would (``python -m harness up / status / down``) in the Compose project of
WIIIIIDE_PROJECT. It uses the image `up` uses (built by `up` when missing), not the `docker_ready`
fixture, so that it never rebuilds an image other runs on this engine may be using.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from harness import REPO_ROOT

pytestmark = pytest.mark.docker

DEADLINE_S = 180.0  # for the first progress lines: start, handshake, 100 steps of a small model


def harness(*args: str, timeout_s: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "harness", *args], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=timeout_s, env=dict(os.environ, COLUMNS="200"))


def rows(out: str) -> dict[str, list[str]]:
    """node -> its cells, from the plain text of `status --once` (stdout is a pipe here)."""
    lines = out.strip().splitlines()
    header = lines[1].split()
    assert header[:4] == ["node", "container", "state", "step"], out
    return {line.split()[0]: line.split() for line in lines[2:]}


def test_status_lists_coordinator_and_worker_with_steps():
    from harness.run.compose_file import PROJECT_LABEL
    from harness.run.compose_project import PROJECT
    from harness.run.docker_client import docker_client

    up = harness("up", "--workers", "1", "--duration-s", "120")
    try:
        assert up.returncode == 0, up.stderr
        deadline = time.monotonic() + DEADLINE_S
        while True:
            status = harness("status", "--once", timeout_s=60)
            assert status.returncode == 0, status.stderr
            table = rows(status.stdout)
            steps = {node: cells[4 if cells[2] == "exited" else 3] for node, cells in table.items()}
            if all(s.isdigit() for s in steps.values()) or time.monotonic() > deadline:
                break
            time.sleep(2)
        assert status.stdout.startswith(f"project {PROJECT}: 1 coordinator + 1 worker"), status.stdout
        assert set(table) == {"coordinator", "worker-1"}, status.stdout
        assert steps["coordinator"].isdigit() and int(steps["coordinator"]) >= 100, status.stdout
        assert steps["worker-1"].isdigit() and int(steps["worker-1"]) >= 99, status.stdout
        coordinator = table["coordinator"]
        if coordinator[2] == "running":  # CPU, memory and network from the Engine API
            memory_mib, net_tx_mb = float(coordinator[7]), float(coordinator[9])
            assert memory_mib > 10 and net_tx_mb > 0, status.stdout  # torch alone is far more than 10 MiB
    finally:
        down = harness("down")
        assert down.returncode == 0, down.stderr
    left = docker_client().containers.list(all=True, filters={"label": f"{PROJECT_LABEL}={PROJECT}"})
    assert left == []
    gone = harness("status", "--once", timeout_s=60)
    assert gone.returncode == 1 and f"no cluster of project {PROJECT} is running" in gone.stderr
