"""Where the two peers run: two local processes over 127.0.0.1, or two containers of the node image.

Each backend returns the source's result with a ``backend`` entry naming it and its transport.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

from harness.bench.wire.channel import PORT, connect
from harness.bench.wire.peer import source
from harness.bench.wire.plan import WirePlan

PEER_MODULE = "harness.bench.wire"  # `python -m harness.bench.wire peer ...`
SINK_START_TIMEOUT_S = 30.0
SINK_EXIT_TIMEOUT_S = 60.0
SOURCE_EXIT_TIMEOUT_S = 60.0  # docker: how long the source container may take to exit after its last line


def peer_argv(role: str, *options: str) -> list[str]:
    """The argv after the interpreter that starts one peer: ``-m harness.bench.wire peer --role <role> ...``."""
    return ["-m", PEER_MODULE, "peer", "--role", role, *options]


def run_local(plan: WirePlan, scratch: Path, progress: Callable[[str], None]) -> dict[str, Any]:
    """The sink as a child process on a free port of 127.0.0.1; the source in this process.

    `scratch` is unused here (the docker backend's exchange folder); kept so both backends are called alike.

    Raises:
        OSError, ConnectionError, ProtocolError: the connection failed. subprocess.TimeoutExpired: the
        sink did not exit within 60 s of ``done`` (it is killed).
    """
    from harness import REPO_ROOT
    from harness.run.local import free_port

    port, iperf3_port = free_port(), free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    sink_proc = subprocess.Popen([sys.executable, *peer_argv("sink", "--port", str(port), "--recv-chunk-bytes",
                                                             str(plan.recv_chunk_bytes), "--read-ahead-bytes",
                                                             str(plan.read_ahead_bytes),
                                                             "--iperf3-port", str(iperf3_port))],
                                 cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, text=True)
    try:
        sink_proc.stdout.readline()  # "listening"
        with connect("127.0.0.1", port, timeout_s=SINK_START_TIMEOUT_S) as sock:
            result = source(sock, plan, progress, iperf3_host="127.0.0.1", iperf3_port=iperf3_port)
        sink_proc.wait(timeout=SINK_EXIT_TIMEOUT_S)
    finally:
        if sink_proc.poll() is None:
            sink_proc.kill()
            sink_proc.wait(timeout=10)
    return {"backend": {"name": "local", "transport": "TCP over 127.0.0.1, two processes"}, **result}


def run_docker(plan: WirePlan, scratch: Path, progress: Callable[[str], None]) -> dict[str, Any]:
    """Sink and source in two containers of the node image on a bridge of this project, removed after
    (`harness.bench.pair.run_pair`, shared with bench-tls and bench-overlay).

    The source writes its result to `scratch` (mounted at /out); the caller removes the folder.

    Raises:
        ClusterError: no engine answered, the image did not build, or the source container failed.
    """
    from harness import REPO_ROOT
    from harness.bench.pair import Peer, run_pair

    scratch.mkdir(parents=True, exist_ok=True)
    mounts = {str(REPO_ROOT / "harness"): ("/app/harness", "ro"), str(scratch.resolve()): ("/out", "rw")}
    sink = Peer(["python", *peer_argv("sink", "--host", "0.0.0.0", "--port", str(PORT),
                                      "--recv-chunk-bytes", str(plan.recv_chunk_bytes),
                                      "--read-ahead-bytes", str(plan.read_ahead_bytes))], "sink", mounts)
    source = Peer(["python", *peer_argv("source", "--host", "sink", "--port", str(PORT),
                                        "--plan", json.dumps(plan.as_dict()), "--out", "/out/source.json")],
                  "source", mounts)
    result, backend = run_pair("bench-wire", sink, source, scratch / "source.json", progress,
                               wait_s=SOURCE_EXIT_TIMEOUT_S)
    (scratch / "source.json").unlink()
    return {"backend": {"name": "docker", "transport": "TCP between two containers on a user-defined bridge",
                        **backend}, **result}


BACKENDS = {"local": run_local, "docker": run_docker}
