"""Fixtures shared by the unit tests: loopback sockets, free ports and bounded node subprocesses."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
TEST_SECRET = "unit-tests-shared-secret-0123456789"  # test_nodes.SECRET, for in-process nodes


@pytest.fixture
def conn_pair():
    """Two `wiiide.wire.node.Connection` ends of one loopback TCP connection, (coordinator's, worker's), named
    "worker 1" and "coordinator"; TCP, as the socket knobs (TCP_QUICKACK) and ``SIOCOUTQ`` need. Each end
    times out after 10 s."""
    from wiiide.config import RunConfig
    from wiiide.log import TieredLog
    from wiiide.metrics import NodeMetrics
    from wiiide.wire.node import Connection

    cfg = RunConfig(log_tier="silent")
    with socket.create_server(("127.0.0.1", 0)) as server:
        b = socket.create_connection(server.getsockname())
        a, _ = server.accept()
    a.settimeout(10)
    b.settimeout(10)
    yield (Connection(a, cfg, NodeMetrics("coordinator", "c"), TieredLog(cfg, "coordinator"), "worker 1"),
           Connection(b, cfg, NodeMetrics("worker", "w"), TieredLog(cfg, "worker"), "coordinator"))
    a.close()
    b.close()


@pytest.fixture
def sock_pair():
    """A connected AF_UNIX stream socket pair (writer, reader); the reader times out after 10 s.

    The timeout turns a reader that blocks where it should have raised into a `socket.timeout`
    (an OSError, not a ProtocolError), so such a test fails instead of hanging.
    """
    writer, reader = socket.socketpair()
    reader.settimeout(10.0)
    writer.settimeout(10.0)
    yield writer, reader
    writer.close()
    reader.close()


@pytest.fixture
def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (bound to port 0, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def node_env(tmp_path, free_port):
    """Factory: the environment of a `python -m wiiide` node, WIIIIIDE_* variables from the caller only."""

    def make(**fields: object) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("WIIIIIDE_")}
        env["PYTHONPATH"] = str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        env["WIIIIIDE_SECRET"] = TEST_SECRET  # wiiide.wire.auth: coordinator and workers share it
        base = {
            "port": free_port,
            "metrics_dir": tmp_path / "metrics",
            "log_tier": "silent",
            "max_steps": 200,
            "duration_s": 60,
            "connect_timeout_s": 60,
            "io_timeout_s": 30,
        }
        base.update(fields)
        for name, value in base.items():
            env["WIIIIIDE_" + name.upper()] = str(value)
        return env

    return make


class NodeProcs:
    """Starts `python -m wiiide <role>` subprocesses and kills (by Popen handle) any left at teardown."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.procs: list[tuple[subprocess.Popen, Path]] = []

    def start(self, role: str, env: dict[str, str], name: str | None = None) -> subprocess.Popen:
        name = name or f"{role}-{len(self.procs)}"
        err_path = self.tmp_path / f"{name}.stderr"
        err = open(err_path, "wb")
        proc = subprocess.Popen([sys.executable, "-m", "wiiide", role], env=env, cwd=REPO_ROOT,
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err)
        err.close()
        proc.stderr_path = err_path  # type: ignore[attr-defined]
        self.procs.append((proc, err_path))
        return proc

    @staticmethod
    def wait(proc: subprocess.Popen, timeout_s: float = 60.0) -> int:
        try:
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
            pytest.fail(f"node process {proc.args} did not end within {timeout_s} s; "
                        f"stderr: {proc.stderr_path.read_text(errors='replace')[-2000:]}")  # type: ignore[attr-defined]

    @staticmethod
    def stderr(proc: subprocess.Popen) -> str:
        return proc.stderr_path.read_text(errors="replace")  # type: ignore[attr-defined]

    def cleanup(self) -> None:
        for proc, _ in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)


@pytest.fixture
def node_procs(tmp_path):
    procs = NodeProcs(tmp_path)
    yield procs
    procs.cleanup()
