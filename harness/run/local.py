"""The local backend: coordinator and workers as processes on 127.0.0.1.

Runs exactly the nodes the containers run (``python -m wiiide coordinator|worker``, configured by
WIIIIIDE_* variables); per-process CPU, memory and I/O come from psutil in place of container stats.
Processes have no network counters of their own: per-node wire bytes come from the nodes' metrics.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil

from harness import REPO_ROOT
from harness.errors import ClusterError
from harness.run.backend import (
    Backend,
    Progress,
    RunResult,
    Sampler,
    collect_nodes,
    default_timeout_s,
    judge,
)
from harness.run.faults import FaultInjector
from harness.run.stats import summarize_samples
from wiiide.auth import generate_secret
from wiiide.config import RunConfig

SAMPLE_INTERVAL_S = 0.5


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalBackend(Backend):
    name = "local"

    def __init__(self) -> None:
        self._procs: dict[str, subprocess.Popen] = {}

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "python": sys.executable, "host": "127.0.0.1"}

    def check_faults(self, faults) -> None:
        """Processes share the host's network: a link cannot be cut for one of them (ClusterError)."""
        if any(f.action == "disconnect" for f in faults or ()):
            raise ClusterError("the local backend cannot disconnect a node's link (processes share loopback); "
                               "use --backend docker for `disconnect` faults")

    def run(self, cfg: RunConfig, out_dir: Path, timeout_s: float | None, progress: Progress,
            cluster=None, faults=()) -> RunResult:
        self.check_cluster(cluster)  # processes on loopback: no links to shape, no limits (ClusterError)
        self.check_faults(faults)
        out_dir = Path(out_dir).resolve()
        nodes_dir, logs_dir = out_dir / "nodes", out_dir / "logs"
        nodes_dir.mkdir(parents=True, exist_ok=True)
        logs_dir.mkdir(parents=True, exist_ok=True)
        cfg = cfg.replace(port=free_port(), coordinator_host="127.0.0.1", bind_host="127.0.0.1",
                          metrics_dir=str(nodes_dir), ready_file="")
        timeout_s = timeout_s or default_timeout_s(cfg)
        base_env = {k: v for k, v in os.environ.items() if not k.startswith("WIIIIIDE_")}
        base_env.update(cfg.to_env())
        base_env["WIIIIIDE_SECRET"] = generate_secret()  # per run; processes of this user only
        base_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), base_env.get("PYTHONPATH")]))
        names = ["coordinator"] + [f"worker-{i + 1}" for i in range(cfg.num_workers)]
        samples: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
        handles: dict[str, psutil.Process] = {}
        t0 = time.monotonic()
        status, error = "ok", None

        def spawn(name: str) -> None:
            role = "coordinator" if name == "coordinator" else "worker"
            env = dict(base_env, WIIIIIDE_NODE_ID=f"local-{name}")  # a restarted node keeps its id
            with open(logs_dir / f"{name}.log", "ab") as log:
                proc = subprocess.Popen([sys.executable, "-m", "wiiide", role], env=env, cwd=REPO_ROOT,
                                        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            self._procs[name] = proc
            try:
                handles[name] = psutil.Process(proc.pid)
            except psutil.Error:
                pass

        injector = FaultInjector(list(faults), _ProcessController(self._procs, spawn), nodes_dir,
                                 wait_s=cfg.connect_timeout_s + 60)
        try:
            for name in names:
                spawn(name)
            injector.start()

            def sample(t_s: float) -> None:
                for name, handle in handles.items():
                    record = _sample_process(handle, t_s)
                    if record is not None:
                        samples[name].append(record)

            sampler = Sampler(sample, SAMPLE_INTERVAL_S).start()
            try:
                next_note = t0 + 10
                while any(p.poll() is None for p in self._procs.values()):
                    now = time.monotonic()
                    if now - t0 > timeout_s:
                        status, error = "failed", f"timed out after {timeout_s:.0f} s; nodes still running were stopped"
                        break
                    if now >= next_note:
                        progress(f"    running: {now - t0:.0f} s of about {cfg.duration_s:.0f} s")
                        next_note = now + 10
                    time.sleep(0.1)
            finally:
                sampler.stop()
        finally:
            injector.stop()
            self.teardown()
        exit_codes = {name: proc.returncode for name, proc in self._procs.items()}
        self._procs = {}
        nodes = collect_nodes(nodes_dir)
        judged_status, judged_error = judge(nodes, exit_codes, cfg.num_workers, expected_dead=injector.affected,
                                            expected_node_ids=injector.affected_node_ids)
        if status == "ok":
            status, error = judged_status, judged_error
        elif judged_error:
            error = f"{error}; {judged_error}"
        containers = {name: {"role": "coordinator" if name == "coordinator" else "worker", "kind": "process",
                             "exit_code": exit_codes.get(name), "samples": samples[name],
                             "summary": summarize_samples(samples[name])} for name in names}
        return RunResult(status, error, time.monotonic() - t0, nodes, containers, exit_codes, str(logs_dir),
                         faults=injector.events)

    def teardown(self) -> None:
        """SIGTERM every node this backend started (by its process group), then SIGKILL after 5 s."""
        for proc in self._procs.values():
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGCONT)  # a paused node must run to handle SIGTERM
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 5
        for proc in self._procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait(timeout=5)


class _ProcessController:
    """Fault actions on the local backend's processes (harness.run.faults.Controller)."""

    def __init__(self, procs: dict[str, subprocess.Popen], spawn) -> None:
        self._procs = procs
        self._spawn = spawn

    def _signal(self, target: str, sig: int) -> None:
        proc = self._procs.get(target)
        if proc is None:
            raise ClusterError(f"no node named {target}")
        if proc.poll() is not None:
            raise ClusterError(f"{target} has already exited ({proc.returncode})")
        os.killpg(proc.pid, sig)

    def kill(self, target: str) -> None:
        self._signal(target, signal.SIGKILL)
        self._procs[target].wait(timeout=10)

    def restart(self, target: str) -> None:
        proc = self._procs.get(target)
        if proc is not None and proc.poll() is None:
            raise ClusterError(f"{target} is still running")
        self._spawn(target)

    def pause(self, target: str) -> None:
        self._signal(target, signal.SIGSTOP)

    def resume(self, target: str) -> None:
        self._signal(target, signal.SIGCONT)

    def node_id(self, target: str) -> str:
        return f"local-{target}"  # as spawn() names it

    def disconnect(self, target: str) -> None:
        raise ClusterError("the local backend cannot disconnect a node")

    reconnect = disconnect


def _sample_process(handle: psutil.Process, t_s: float) -> dict[str, Any] | None:
    try:
        with handle.oneshot():
            cpu = handle.cpu_percent(interval=None)
            rss = handle.memory_info().rss
            try:
                io = handle.io_counters()
                read, write = io.read_bytes, io.write_bytes
            except (psutil.AccessDenied, AttributeError):
                read = write = None
    except psutil.Error:
        return None
    return {"t_s": round(t_s, 3), "cpu_percent": cpu, "memory_bytes": rss, "net_rx_bytes": None,
            "net_tx_bytes": None, "blk_read_bytes": read, "blk_write_bytes": write}
