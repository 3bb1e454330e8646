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
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import psutil

from harness import REPO_ROOT
from harness.errors import ClusterError
from harness.run.backend import (
    Collected,
    PhaseClock,
    Progress,
    Sampler,
    refuse_cluster_settings,
)
from harness.run.certs import write_cluster_tls
from harness.run.faults import Controller
from harness.run.stats import summarize_samples
from harness.spec.cluster import ClusterSettings
from harness.spec.faults import Fault
from wiiide.config import RunConfig
from wiiide.wire.auth import generate_secret

SAMPLE_INTERVAL_S = 0.5  # seconds between psutil samples of each node process
STOP_GRACE_S = 5.0  # seconds a node has to exit after SIGTERM before SIGKILL


@contextmanager
def _signals_deferred(signums: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM)) -> Iterator[None]:
    """Hold SIGINT/SIGTERM for the ``with`` body and hand the first one that came to the handler that
    was in place, once the body is done (main thread only; elsewhere signals are not delivered anyway).
    Unlike blocking them with ``pthread_sigmask``, nothing is inherited by the processes started inside."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[tuple[int, Any]] = []
    previous = {s: signal.signal(s, lambda signum, frame: pending.append((signum, frame))) for s in signums}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if pending:
            signum, frame = pending[0]
            handler = previous[signum]
            if callable(handler):
                handler(signum, frame)
            elif handler == signal.SIG_DFL and signum == signal.SIGINT:
                raise KeyboardInterrupt
            elif handler == signal.SIG_DFL:
                os.kill(os.getpid(), signum)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalBackend:
    """The ``local`` `harness.run.backend.Backend`: nodes as processes of this user on 127.0.0.1.

    Applies no links and no CPU/memory limits (`check_cluster` refuses them) and cannot cut one
    process's link (`check_faults` refuses ``disconnect``); kill, restart, pause and resume work.
    """

    name = "local"
    poll_interval_s = 0.25  # a process poll: no daemon call

    def __init__(self, popen: Callable[..., Any] = subprocess.Popen) -> None:
        """`popen`: how a node's process starts (``subprocess.Popen``'s signature and the object's ``pid``,
        ``poll``, ``wait``, ``returncode``); tests that run many short runs pass a fork server's
        (`tests/integration/warm_nodes.py`), which skips each node's imports."""
        self._popen = popen
        self._procs: dict[str, subprocess.Popen] = {}
        self._handles: dict[str, psutil.Process] = {}
        self._samples: dict[str, list[dict[str, Any]]] = {}
        self._sampler: Sampler | None = None

    def describe(self) -> dict[str, Any]:
        """``{name, python, host}``: the interpreter the nodes run with and where they listen."""
        return {"name": self.name, "python": sys.executable, "host": "127.0.0.1"}

    @classmethod
    def check_cluster(cls, cluster: ClusterSettings | None) -> None:
        """Processes on loopback: no links to shape, no limits. Raises ClusterError if any is asked."""
        refuse_cluster_settings(cls.name, cluster)

    @classmethod
    def check_faults(cls, faults: Sequence[Fault]) -> None:
        """Processes share the host's network: a link cannot be cut for one of them (ClusterError)."""
        if any(f.action == "disconnect" for f in faults or ()):
            raise ClusterError("the local backend cannot disconnect a node's link (processes share loopback); "
                               "use --backend docker for `disconnect` faults")

    def start(self, cfg: RunConfig, out_dir: Path, cluster: ClusterSettings, progress: Progress,
              clock: PhaseClock) -> Controller:
        """Spawn the coordinator and `cfg.num_workers` workers (``python -m wiiide ROLE``) on a free
        port with a fresh shared secret (and with ``tls``, a fresh CA and node certificates under
        ``out_dir/tls``), and sample each process every `SAMPLE_INTERVAL_S` seconds.

        Raises:
            ClusterError: `cluster` asks for links or limits.
        """
        self.check_cluster(cluster)
        nodes_dir, logs_dir = out_dir / "nodes", out_dir / "logs"
        cfg = cfg.replace(port=free_port(), coordinator_host="127.0.0.1", bind_host="127.0.0.1",
                          metrics_dir=str(nodes_dir), ready_file="")
        base_env = {k: v for k, v in os.environ.items() if not k.startswith("WIIIIIDE_")}
        base_env.update(cfg.to_env())
        base_env["WIIIIIDE_SECRET"] = generate_secret()  # per run; processes of this user only
        base_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), base_env.get("PYTHONPATH")]))
        names = ["coordinator"] + [f"worker-{i + 1}" for i in range(cfg.num_workers)]
        # tls: a CA and a certificate per node in the run's folder (harness.run.certs); all on loopback
        tls = write_cluster_tls(out_dir / "tls", {n: [n, "localhost", "127.0.0.1"] for n in names}) if cfg.tls else {}
        self._samples = {n: [] for n in names}
        self._handles = {}

        def spawn(name: str) -> None:
            role = "coordinator" if name == "coordinator" else "worker"
            env = dict(base_env, WIIIIIDE_NODE_ID=f"local-{name}")  # a restarted node keeps its id
            if name in tls:
                env.update(tls[name].env())
            # SIGINT/SIGTERM deferred until the process is registered: the sweep's handler raises, and
            # a node spawned but not yet in self._procs would outlive the teardown (seen when Ctrl-C
            # came as the next point started)
            with _signals_deferred():
                with open(logs_dir / f"{name}.log", "ab") as log:
                    proc = self._popen([sys.executable, "-m", "wiiide", role], env=env, cwd=REPO_ROOT,
                                       stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
                self._procs[name] = proc
            try:
                self._handles[name] = psutil.Process(proc.pid)
            except psutil.Error:
                pass

        with clock.phase("create"):
            for name in names:
                spawn(name)

        def sample(t_s: float) -> None:
            for name, handle in list(self._handles.items()):
                record = _sample_process(handle, t_s)
                if record is not None:
                    self._samples[name].append(record)

        self._sampler = Sampler(sample, SAMPLE_INTERVAL_S).start()
        return _ProcessController(self._procs, spawn)

    def poll(self) -> dict[str, str]:
        """Each process: ``running`` or ``exited``."""
        return {name: "running" if proc.poll() is None else "exited" for name, proc in self._procs.items()}

    def exit_code(self, name: str) -> int | None:
        """Node `name`'s exit code now (negative: killed by that signal); None while it runs or if unknown."""
        proc = self._procs.get(name)
        return None if proc is None else proc.poll()

    def stop(self) -> None:
        """Stop sampling, then every node still running (SIGTERM to its process group, SIGKILL after
        `STOP_GRACE_S` seconds)."""
        if self._sampler is not None:
            self._sampler.stop()
            self._sampler = None
        self._terminate()

    def collect(self, logs_dir: Path, progress: Progress) -> Collected:
        """Exit codes (negative: killed by that signal) and psutil samples; the logs are already files."""
        exit_codes = {name: proc.returncode for name, proc in self._procs.items()}
        containers = {name: {"role": "coordinator" if name == "coordinator" else "worker", "kind": "process",
                             "exit_code": exit_codes.get(name), "samples": samples,
                             "summary": summarize_samples(samples)} for name, samples in self._samples.items()}
        return Collected(exit_codes=exit_codes, containers=containers)

    def teardown(self) -> None:
        """Stop every node this backend started (see `stop`) and forget them. Idempotent."""
        if self._sampler is not None:
            self._sampler.stop()
            self._sampler = None
        self._terminate()
        self._procs = {}

    def _terminate(self) -> None:
        for proc in self._procs.values():
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGCONT)  # a paused node must run to handle SIGTERM
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + STOP_GRACE_S
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
        """SIGKILL the target's process group and wait for it."""
        self._signal(target, signal.SIGKILL)
        self._procs[target].wait(timeout=10)

    def restart(self, target: str) -> None:
        """Spawn the (exited) target again, same node id; ClusterError while it runs."""
        proc = self._procs.get(target)
        if proc is not None and proc.poll() is None:
            raise ClusterError(f"{target} is still running")
        self._spawn(target)

    def pause(self, target: str) -> None:
        """SIGSTOP the target's process group."""
        self._signal(target, signal.SIGSTOP)

    def resume(self, target: str) -> None:
        """SIGCONT the target's process group."""
        self._signal(target, signal.SIGCONT)

    def node_id(self, target: str) -> str:
        """``local-<target>``, as the node was spawned."""
        return f"local-{target}"  # as spawn() names it

    def disconnect(self, target: str) -> None:
        """Always ClusterError: processes share loopback."""
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
