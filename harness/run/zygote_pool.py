"""Warm node containers kept between runs (``--reuse``, the default of ``sweep`` and ``bench-overhead``):
the host side of `wiiide.zygote`.

A pool is one cluster of containers whose nodes are zygotes: they imported torch once, and each run
forks a fresh node process in every one of them (`wiiide.zygote`). The pool is kept for the next run
when that run asks for the same cluster (`pool_key`: image, worker count, cluster settings, results
mount, the congestion control set on the routes) and the run ended clean (every node exited 0, no fault touched a container); anything else
removes it and the next run starts fresh containers. A kept container's link shaping is removed
before it is shaped again (`harness.run.tc_exec.reset_links`).

This module keeps the pool's bookkeeping and its control directory on the host (mounted at
``/zygote`` in every container): the run request, and the per-node start, exit and log files the
zygotes write. The docker calls are `harness.run.compose.ComposeBackend`'s.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from harness.spec.cluster import ClusterSettings

RUNS_DIR = "runs"
REQUEST_FILE = "request.json"


def pool_key(image: str, num_workers: int, cluster: ClusterSettings, results_root: Path,
             route_congestion: str = "") -> str:
    """What a run's containers are made of, as a string to compare: two runs with equal keys can share
    containers (their nodes' knobs differ only in what each run's request carries).

    `route_congestion`: the congestion control a run sets on its containers' routes (the ddp and fsdp
    engines' ``tcp_congestion``, `wiiide.wire.sockets.set_route_congestion`; '' for none). The routes outlive a
    run in a kept container, so a run that sets none must not inherit one."""
    return json.dumps({"image": image, "num_workers": num_workers, "cluster": cluster.to_dict(),
                       "results_root": str(results_root), "route_congestion": route_congestion},
                      sort_keys=True, default=str)


def results_root(out_dir: Path) -> Path:
    """The host folder mounted at ``/results`` for a pool: the run folder's grandparent (a sweep's
    folder: ``<sweep>/point-NNN/repeat-R``; the benchmark's results folder), so the runs of a point,
    and of points of the same cluster, share the mount; the parent when the grandparent is ``/``."""
    out_dir = Path(out_dir).resolve()
    root = out_dir.parent.parent
    return out_dir.parent if root == root.parent else root


class ZygotePool:
    """One project's warm containers and their control directory `control_dir` (host side).

    Attributes: `key` (`pool_key` of the containers, None when there are none), `containers` (docker
    SDK objects, the coordinator first), `slots` (container name -> ``coordinator``/``worker-N``),
    `run_id` (the current run's id), `clean` (whether the current run left the containers fit for the
    next one: set by the backend after it read the run's end).
    """

    def __init__(self, control_dir: Path) -> None:
        self.control_dir = Path(control_dir)
        self.key: str | None = None
        self.root: Path | None = None
        self.containers: list = []
        self.slots: dict[str, str] = {}
        self.run_id: str | None = None
        self.runs = 0
        self.clean = False
        self.dirty_reason: str | None = None

    def usable(self, key: str) -> bool:
        """Whether the pool holds containers made for `key`."""
        return bool(self.containers) and self.key == key

    def reset(self) -> None:
        """Forget the containers (already removed by the caller) and empty the control directory."""
        self.key, self.root, self.containers, self.slots, self.run_id = None, None, [], {}, None
        self.clean, self.dirty_reason = False, None
        shutil.rmtree(self.control_dir, ignore_errors=True)
        self.control_dir.mkdir(parents=True, exist_ok=True)

    def adopt(self, key: str, root: Path, containers: list, slots: dict[str, str]) -> None:
        """Take `containers` (just created for `key`, results mount `root`) as the pool."""
        self.key, self.root, self.containers, self.slots = key, Path(root), list(containers), dict(slots)

    def next_run_id(self) -> str:
        """A new run id (``run-0001``...), made current; the run counts as not clean until said so."""
        self.runs += 1
        self.run_id = f"run-{os.getpid()}-{self.runs:04d}"
        self.clean, self.dirty_reason = False, None
        return self.run_id

    def mark_dirty(self, reason: str) -> None:
        """The current run did something to a container (a fault, a shaped link): not to be reused."""
        self.clean = False
        self.dirty_reason = self.dirty_reason or reason

    def write_request(self, envs: dict[str, dict[str, str]]) -> None:
        """Ask every zygote to run the current run: `envs` maps a role (``coordinator``, ``worker``)
        to its node's ``WIIIIIDE_*`` variables. Written atomically (`wiiide.zygote.read_request`).

        Raises:
            OSError: the control directory cannot be written.
        """
        if self.run_id is None:
            raise ValueError("write_request before next_run_id: no current run")
        self.run_dir().mkdir(parents=True, exist_ok=True)
        path = self.control_dir / REQUEST_FILE
        tmp = path.with_name(f".{REQUEST_FILE}.tmp")
        tmp.write_text(json.dumps({"run_id": self.run_id, "env": envs}))
        os.replace(tmp, path)

    def run_dir(self) -> Path:
        """The current run's folder of start, exit and log files."""
        return self.control_dir / RUNS_DIR / str(self.run_id)

    def _read(self, name: str) -> dict[str, Any] | None:
        try:
            data = json.loads((self.run_dir() / name).read_text())
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    def exit_record(self, slot: str) -> dict[str, Any] | None:
        """``{exit_code, started_at_utc, finished_at_utc}`` of `slot`'s node in the current run, None
        while it runs (or if it never started)."""
        return self._read(f"{slot}.exit.json")

    def start_record(self, slot: str) -> dict[str, Any] | None:
        """``{started_at_utc}`` of `slot`'s node in the current run, None before it was forked."""
        return self._read(f"{slot}.start.json")

    def log_bytes(self, slot: str) -> bytes:
        """`slot`'s node output in the current run (empty when there is none)."""
        try:
            return (self.run_dir() / f"{slot}.log").read_bytes()
        except OSError:
            return b""

    def end_run(self) -> None:
        """Remove the current run's control files (after they were collected)."""
        if self.run_id is not None:
            shutil.rmtree(self.run_dir(), ignore_errors=True)
        try:
            (self.control_dir / REQUEST_FILE).unlink()
        except OSError:
            pass
