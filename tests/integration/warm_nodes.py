"""A fork server for local-backend tests that run many short runs (`harness.run.local.LocalBackend`'s
``popen``): one warm process imports what a node needs once (`wiiide.zygote.preload`) and forks every
node from it, as the zygote does in containers, so a run does not pay three interpreters' imports of
torch (about 1.2 s of CPU each). Each node is still a fresh process of its own session (its process
group is its pid, as ``start_new_session`` makes it), with the run's environment, its log file and its
own exit code (`wiiide.zygote._run_child`).

The server (``python -m tests.integration.warm_nodes``) reads one JSON request a line on stdin
(``{"id", "role", "env", "cwd", "log"}``) and answers on stdout ``{"id", "pid"}`` once forked, then
``{"pid", "exit"}`` once reaped (the exit code as `subprocess.Popen.returncode` gives it: negative for
a signal). It forks only from its one thread, between reads.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]


def serve() -> None:
    """The server's loop (module docstring), until stdin closes."""
    from wiiide.zygote import _run_child, preload

    preload()
    pending = b""
    while True:
        readable, _, _ = select.select([0], [], [], 0.02)
        if readable:
            chunk = os.read(0, 1 << 16)
            if not chunk:
                return
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                sys.stdout.flush()
                pid = os.fork()
                if pid == 0:
                    os.setsid()
                    devnull = os.open(os.devnull, os.O_RDONLY)
                    os.dup2(devnull, 0)
                    os.chdir(request["cwd"])
                    _run_child(request["role"], request["env"], Path(request["log"]))
                print(json.dumps({"id": request["id"], "pid": pid}), flush=True)
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            print(json.dumps({"pid": pid, "exit": os.waitstatus_to_exitcode(status)}), flush=True)


class WarmNodes:
    """The test side: starts the server; `popen` has `subprocess.Popen`'s signature for the local backend's
    ``[python, -m, wiiide, role]`` nodes. Use as a context manager (the server ends with it)."""

    def __init__(self) -> None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
        self._server = subprocess.Popen([sys.executable, "-m", "tests.integration.warm_nodes"], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, cwd=REPO_ROOT, env=env)
        self._cond = threading.Condition()
        self._pids: dict[int, int] = {}
        self.exits: dict[int, int] = {}
        self._next = 0
        threading.Thread(target=self._read, name="warm nodes", daemon=True).start()

    def _read(self) -> None:
        assert self._server.stdout is not None
        for line in self._server.stdout:
            msg = json.loads(line)
            with self._cond:
                if "id" in msg:
                    self._pids[msg["id"]] = msg["pid"]
                else:
                    self.exits[msg["pid"]] = msg["exit"]
                self._cond.notify_all()

    def popen(self, args: list[str], env: dict[str, str], cwd: Any, stdout: Any, stderr: Any = None,
              start_new_session: bool = True) -> "_WarmProcess":
        """Fork node ``args[-1]`` (coordinator or worker) with `env`, its output to `stdout`'s file."""
        assert args[1:3] == ["-m", "wiiide"], args
        with self._cond:
            self._next += 1
            ident = self._next
        request = {"id": ident, "role": args[-1], "env": dict(env), "cwd": str(cwd), "log": stdout.name}
        assert self._server.stdin is not None
        self._server.stdin.write((json.dumps(request) + "\n").encode())
        self._server.stdin.flush()
        with self._cond:
            if not self._cond.wait_for(lambda: ident in self._pids, timeout=30):
                raise RuntimeError("the warm node server did not fork within 30 s")
            return _WarmProcess(self, self._pids[ident])

    def __enter__(self) -> "WarmNodes":
        return self

    def __exit__(self, *exc: Any) -> None:
        assert self._server.stdin is not None
        self._server.stdin.close()
        self._server.wait(timeout=30)


class _WarmProcess:
    """What the local backend reads of a node's `subprocess.Popen`: pid, poll, wait, returncode."""

    def __init__(self, nodes: WarmNodes, pid: int) -> None:
        self.nodes, self.pid = nodes, pid

    @property
    def returncode(self) -> int | None:
        with self.nodes._cond:
            return self.nodes.exits.get(self.pid)

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.nodes._cond:
            while self.pid not in self.nodes.exits:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise subprocess.TimeoutExpired(f"node {self.pid}", timeout)
                self.nodes._cond.wait(left)
            return self.nodes.exits[self.pid]


if __name__ == "__main__":
    serve()
