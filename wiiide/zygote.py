"""``python -m wiiide.zygote coordinator|worker``: a warm node that runs one fresh node process per run.

A node spends about 1.2 s of CPU importing torch, numpy and wiiide before its first step; nine of
them on two cores cost a run 5-6 s of wall time. A zygote imports those modules once, then waits for
run requests and forks a child per run: each run still gets a fresh process (fresh interpreter
state, fresh sockets, its own config and exit code), without paying the imports again. The harness
(``harness.run.compose``, ``--reuse``) keeps such containers between the runs of a point.

The control directory (`CONTROL_DIR`, a bind mount the harness writes) holds:

- ``request.json``: ``{"run_id": str, "env": {role: {WIIIIIDE_*: str}}}`` (role ``coordinator`` or
  ``worker``), written atomically by the harness;
  a run is started once per zygote for each new ``run_id`` without an exit file of this slot;
- ``runs/<run_id>/<slot>.log``: the child's stdout and stderr (appended);
- ``runs/<run_id>/<slot>.start.json``: ``{"started_at_utc", "counters"}`` when the child was forked
  (`counters`: the container's byte counters then, the baseline of this run's stats);
- ``runs/<run_id>/<slot>.exit.json``: ``{"exit_code", "started_at_utc", "finished_at_utc"}`` once it ended
  (exit code as a shell reports it: 128 + N for a signal N).

`slot` is ``$NODE_ZYGOTE_SLOT`` (``coordinator``, ``worker-3``). A zygote whose container was
restarted (a ``restart`` fault after a ``kill``) finds the current request without its exit file and
runs it again, as a fresh container would run its node again. SIGTERM to the zygote is passed on to
the running child; the zygote then exits 143.
"""

from __future__ import annotations

import io
import json
import os
import signal
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

CONTROL_DIR = Path(os.environ.get("NODE_ZYGOTE_DIR", "/zygote"))
SLOT_ENV = "NODE_ZYGOTE_SLOT"  # not WIIIIIDE_*: RunConfig refuses unknown knobs
ENV_PREFIX = "WIIIIIDE_"
POLL_INTERVAL_S = 0.02  # how often the zygote looks for a new request
EXIT_TERMINATED = 143

_child_pid: int | None = None


def utc_now() -> str:
    """The time now as RFC 3339 UTC with microseconds and a ``Z`` (as the Engine API's times)."""
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    """Write `data` as JSON to `path` through a temporary file and a rename. Raises OSError."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def read_request(control_dir: Path) -> dict[str, Any] | None:
    """The current request (``run_id``, ``env``), or None when there is none or it cannot be read yet."""
    try:
        data = json.loads((control_dir / "request.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or not isinstance(data.get("run_id"), str) or not isinstance(data.get("env"), dict):
        return None
    return data


def child_environ(base: dict[str, str], run_env: dict[str, Any]) -> dict[str, str]:
    """The child's environment: `base` without its ``WIIIIIDE_*`` knobs (those of the container's
    creation), plus the run's `run_env`."""
    env = {k: v for k, v in base.items() if not k.startswith(ENV_PREFIX)}
    env.update({str(k): str(v) for k, v in run_env.items()})
    return env


def counters() -> dict[str, int]:
    """This container's cumulative byte counters now, as the Engine API's stats count them: received
    and sent on its ``eth*`` interfaces (``/proc/net/dev``; not ``lo``, nor an ``ifb`` of the link
    shaping), read and written by its cgroup (blkio, cgroup v1; ``io.stat``, v2). Keys as
    `harness.run.stats.CUMULATIVE_KEYS`; a counter that cannot be read is left out."""
    out: dict[str, int] = {}
    try:
        rx = tx = 0
        for line in Path("/proc/net/dev").read_text().splitlines()[2:]:
            name, _, fields = line.partition(":")
            if name.strip().startswith("eth"):
                values = fields.split()
                rx, tx = rx + int(values[0]), tx + int(values[8])
        out.update(net_rx_bytes=rx, net_tx_bytes=tx)
    except (OSError, ValueError, IndexError):
        pass
    try:
        read = write = 0
        v1 = Path("/sys/fs/cgroup/blkio/blkio.throttle.io_service_bytes_recursive")
        if v1.exists():
            for line in v1.read_text().splitlines():
                parts = line.split()
                if len(parts) == 3 and parts[1] in ("Read", "Write"):
                    read, write = (read + int(parts[2]), write) if parts[1] == "Read" else (read, write + int(parts[2]))
        else:
            for line in Path("/sys/fs/cgroup/io.stat").read_text().splitlines():
                stats = dict(item.split("=", 1) for item in line.split()[1:] if "=" in item)
                read, write = read + int(stats.get("rbytes", 0)), write + int(stats.get("wbytes", 0))
        out.update(blk_read_bytes=read, blk_write_bytes=write)
    except (OSError, ValueError):
        pass
    return out


def exit_code_of(status: int) -> int:
    """A `os.waitpid` status as a shell reports it: the exit code, or 128 + N for signal N."""
    code = os.waitstatus_to_exitcode(status)
    return code if code >= 0 else 128 - code


def _run_child(role: str, env: dict[str, str], log_path: Path) -> None:
    """In the forked child: the run's environment, output to `log_path`, default signals, then the
    node's own ``main``; never returns (`wiiide.__main__.exit_now`)."""
    code = 1
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.environ.clear()
        os.environ.update(env)
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        # the Python streams too (they may not be fds 1 and 2, e.g. under a test runner's capture)
        sys.stdout = io.TextIOWrapper(open(1, "wb", closefd=False), line_buffering=True)
        sys.stderr = io.TextIOWrapper(open(2, "wb", closefd=False), line_buffering=True)
        from wiiide.__main__ import main
        code = main([role])
    except BaseException as exc:  # anything before or around main: one line in the log, exit 1
        try:
            print(f"wiiide zygote child: {type(exc).__name__}: {exc}", file=sys.stderr)
        except Exception:
            pass
    finally:
        from wiiide.__main__ import exit_now
        exit_now(code)


def run_once(role: str, slot: str, request: dict[str, Any], control_dir: Path) -> int:
    """Fork one child for `request`, wait for it, write its start and exit files; return its exit code."""
    global _child_pid
    run_dir = control_dir / "runs" / request["run_id"]
    run_dir.mkdir(parents=True, exist_ok=True)
    env = child_environ(dict(os.environ), request["env"].get(role) or {})
    started = utc_now()
    write_json_atomic(run_dir / f"{slot}.start.json", {"started_at_utc": started, "counters": counters()})
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        _run_child(role, env, run_dir / f"{slot}.log")
    _child_pid = pid
    while True:
        try:
            _, status = os.waitpid(pid, 0)
            break
        except InterruptedError:
            continue
    _child_pid = None
    code = exit_code_of(status)
    write_json_atomic(run_dir / f"{slot}.exit.json",
                      {"exit_code": code, "started_at_utc": started, "finished_at_utc": utc_now()})
    return code


def _on_sigterm(signum: int, frame: Any) -> None:
    """Pass SIGTERM on to the running child, wait for it, and exit 143."""
    if _child_pid is not None:
        try:
            os.kill(_child_pid, signal.SIGTERM)
            os.waitpid(_child_pid, 0)
        except OSError:
            pass
    os._exit(EXIT_TERMINATED)


def preload() -> None:
    """Import what every node needs before its first step (torch, numpy, the node modules): the cost
    a zygote pays once instead of once per run. Nothing is seeded or started here: the nodes seed
    every generator they use from their config (`wiiide.training.model`, `wiiide.training.data`), torch's default
    generator is as in a fresh interpreter, and no thread runs when the zygote forks."""
    import numpy  # noqa: F401
    import numpy.random  # noqa: F401  (the coordinator's batch sampler; every generator is seeded per run)
    import torch  # noqa: F401

    import wiiide.__main__  # noqa: F401
    import wiiide.server.coordinator  # noqa: F401
    import wiiide.worker  # noqa: F401


def main(argv: list[str] | None = None) -> int:
    """Preload, then serve run requests from `CONTROL_DIR` until SIGTERM (exit 143).

    Returns 2 (bad usage) when the role is not ``coordinator`` or ``worker`` or ``$NODE_ZYGOTE_SLOT``
    is unset; never returns otherwise.
    """
    argv = sys.argv[1:] if argv is None else argv
    slot = os.environ.get(SLOT_ENV, "")
    if len(argv) != 1 or argv[0] not in ("coordinator", "worker") or not slot:
        print(f"usage: {SLOT_ENV}=<slot> python -m wiiide.zygote coordinator|worker", file=sys.stderr)
        return 2
    role = argv[0]
    signal.signal(signal.SIGTERM, _on_sigterm)
    preload()
    print(f"wiiide zygote {slot}: ready, waiting for runs in {CONTROL_DIR}", flush=True)
    done: set[str] = set()
    while True:
        request = read_request(CONTROL_DIR)
        if request is not None and request["run_id"] not in done:
            done.add(request["run_id"])
            if not (CONTROL_DIR / "runs" / request["run_id"] / f"{slot}.exit.json").exists():
                code = run_once(role, slot, request, CONTROL_DIR)
                print(f"wiiide zygote {slot}: run {request['run_id']} exited {code}", flush=True)
        time.sleep(POLL_INTERVAL_S)


if __name__ == "__main__":
    sys.exit(main())
