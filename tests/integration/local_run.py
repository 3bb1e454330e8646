"""Helpers for integration tests that drive one run on the local backend directly (no sweep)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable

from harness.run.backend import PhaseClock, collect_nodes, judge
from harness.run.local import LocalBackend
from harness.spec.cluster import ClusterSettings
from wiiide.config import RunConfig


def wait_for(predicate: Callable[[], Any], timeout_s: float, what: str) -> Any:
    """Poll `predicate` every 10 ms until it returns something true (returned); AssertionError after
    `timeout_s` seconds."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.01)
    raise AssertionError(f"{what} did not happen within {timeout_s} s")


def run_local(cfg: RunConfig, out: Path, fault: Callable[[Any], None] | None = None, popen: Any = None) -> dict:
    """Start `cfg` on the local backend with its output in `out`, call `fault(controller)` (if given)
    while it runs, wait up to 120 s for every node to exit, tear down, assert the run ended ok and
    return the nodes' metrics (`collect_nodes`). `popen`: how nodes start (`LocalBackend`'s; None:
    ``subprocess.Popen``; a `tests.integration.warm_nodes.WarmNodes`' forks them warm)."""
    backend = LocalBackend() if popen is None else LocalBackend(popen)
    for folder in ("nodes", "logs"):
        (out / folder).mkdir(parents=True)
    try:
        controller = backend.start(cfg, out, ClusterSettings(), lambda line: None, PhaseClock())
        if fault is not None:
            fault(controller)
        wait_for(lambda: all(state == "exited" for state in backend.poll().values()), 120, "the run's end")
        collected = backend.collect(out / "logs", lambda line: None)
    finally:
        backend.teardown()
    nodes = collect_nodes(out / "nodes")
    status, error = judge(nodes, collected.exit_codes, cfg.num_workers)
    assert status == "ok", error  # every node ended ok: nobody was left behind
    return nodes


def run_nodes(node_env, node_procs, metrics_dir: Path, fields: dict) -> dict:
    """Run a coordinator and ``fields["num_workers"]`` workers as ``python -m wiiide`` subprocesses (the
    `node_env` / `node_procs` fixtures), assert every one exits 0 within 120 s, and return their metrics
    files by name (``coordinator``, ``worker-1`` ...)."""
    fields = {**fields, "metrics_dir": metrics_dir}
    coord = node_procs.start("coordinator", node_env(node_id="coord", **fields), name=f"{metrics_dir.name}-coord")
    workers = [node_procs.start("worker", node_env(node_id=f"w{i}", **fields), name=f"{metrics_dir.name}-w{i}")
               for i in range(1, fields["num_workers"] + 1)]
    codes = [node_procs.wait(p, 120) for p in (coord, *workers)]
    assert codes == [0] * len(codes), [node_procs.stderr(p)[-1500:] for p in (coord, *workers)]
    return {p.stem: json.loads(p.read_text()) for p in metrics_dir.glob("*.json")}
