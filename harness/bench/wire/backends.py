"""Where the two peers run: two local processes over 127.0.0.1, or two containers of the node image.

Each backend returns the source's result with a ``backend`` entry naming it and its transport.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

from harness.bench.wire.channel import PORT, connect
from harness.bench.wire.peer import source
from harness.bench.wire.plan import WirePlan

PEER_MODULE = "harness.bench.wire"  # `python -m harness.bench.wire peer ...`
SINK_START_TIMEOUT_S = 30.0
SINK_EXIT_TIMEOUT_S = 60.0


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
                                                             str(plan.recv_chunk_bytes),
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
    """Sink and source in two containers of the node image on a bridge of this project, removed after.

    The source writes its result to `scratch` (mounted at /out); the caller removes the folder.

    Raises:
        ClusterError: no engine answered, the image did not build, or the source container failed.
    """
    from harness import REPO_ROOT
    from harness.errors import ClusterError
    from harness.run.compose import DEFAULT_IMAGE, PROJECT, PROJECT_LABEL, SERVICE_LABEL
    from harness.run.docker_client import docker_client
    from harness.run.image import build_image

    client = docker_client(timeout_s=600)  # ClusterError, with how to start an engine, when none answers
    build_image(log=progress)  # seconds when cached; never stale
    labels = {PROJECT_LABEL: PROJECT, SERVICE_LABEL: "bench-wire"}
    stamp = datetime.now(timezone.utc).strftime("%H%M%S")
    network = client.networks.create(f"{PROJECT}-bench-wire-{stamp}", driver="bridge", labels=labels)
    scratch.mkdir(parents=True, exist_ok=True)
    volumes = {str(REPO_ROOT / "harness"): {"bind": "/app/harness", "mode": "ro"},
               str(scratch.resolve()): {"bind": "/out", "mode": "rw"}}
    containers = []
    try:
        sink_c = client.containers.run(
            DEFAULT_IMAGE, ["python", *peer_argv("sink", "--host", "0.0.0.0", "--port", str(PORT),
                                                 "--recv-chunk-bytes", str(plan.recv_chunk_bytes))],
            name=f"{PROJECT}-bench-sink-{stamp}", hostname="sink", detach=True, network=network.name,
            labels=labels, volumes=volumes)
        containers.append(sink_c)
        src_c = client.containers.run(
            DEFAULT_IMAGE, ["python", *peer_argv("source", "--host", "sink", "--port", str(PORT),
                                                 "--plan", json.dumps(plan.as_dict()), "--out", "/out/source.json")],
            name=f"{PROJECT}-bench-source-{stamp}", detach=True, network=network.name, labels=labels,
            volumes=volumes)
        containers.append(src_c)
        for line in src_c.logs(stream=True, follow=True):
            progress(line.decode(errors="replace").rstrip())
        status = src_c.wait(timeout=60)
        if status.get("StatusCode") != 0:
            raise ClusterError(f"bench-wire source container exited {status.get('StatusCode')}: "
                               f"{src_c.logs(tail=20).decode(errors='replace')}")
        result = json.loads((scratch / "source.json").read_text())
        (scratch / "source.json").unlink()
        version = client.version()
    finally:
        for c in containers:
            try:
                c.remove(force=True)
            except Exception as exc:  # keep removing the rest; report what is left
                progress(f"could not remove container {c.name}: {exc}")
        network.remove()
    return {"backend": {"name": "docker", "transport": "TCP between two containers on a user-defined bridge",
                        "engine_version": version.get("Version"), "image": DEFAULT_IMAGE, "project": PROJECT},
            **result}


BACKENDS = {"local": run_local, "docker": run_docker}
