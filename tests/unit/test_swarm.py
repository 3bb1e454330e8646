"""The swarm backend's pure parts: the stack files generated from compose.yaml, the per-node engine
endpoints, and how a task's container is presented to the shaping and fault code. No engine needed."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
import yaml

from harness import REPO_ROOT
from harness.errors import ClusterError
from harness.run.backend import _node_name, judge
from harness.run.shaping import container_identity
from harness.run.swarm.stack import stack_base, stack_override, write_stack_files
from harness.run.swarm.tasks import (
    ENDPOINTS_ENV,
    NodeEngines,
    TaskContainer,
    parse_endpoints,
)


def compose() -> dict:
    return yaml.safe_load((REPO_ROOT / "compose.yaml").read_text())


def test_stack_base_moves_limits_and_drops_what_the_stack_loader_refuses():
    base = stack_base(compose())
    assert not any(str(k).startswith("x-") for k in base)
    for name in ("coordinator", "worker"):
        svc = base["services"][name]
        for key in ("cpus", "mem_limit", "depends_on", "restart", "expose"):
            assert key not in svc, (name, key)
        assert set(svc["deploy"]["resources"]["limits"]) == {"cpus", "memory"}
        assert svc["cap_add"] == ["NET_ADMIN"]
        assert svc["secrets"] == ["wiiide_secret"]
    # the limit variables stay for the CLI to substitute, the same ones Compose reads
    assert base["services"]["worker"]["deploy"]["resources"]["limits"]["cpus"] == "${WIIIIIDE_WORKER_CPUS:-0}"
    assert base["services"]["coordinator"]["environment"]["WIIIIIDE_COORDINATOR_HOST"] == "coordinator"


def test_stack_base_refuses_keys_the_stack_would_ignore():
    data = compose()
    data["services"]["worker"]["container_name"] = "w"
    with pytest.raises(ClusterError, match="services.worker.container_name.*ignores"):
        stack_base(data)


def test_stack_override_numbers_workers_by_slot_and_never_restarts():
    over = stack_override(3, "wiiide", max_replicas_per_node=1)
    worker, coordinator = over["services"]["worker"], over["services"]["coordinator"]
    assert worker["deploy"]["replicas"] == 3 and coordinator["deploy"]["replicas"] == 1
    assert worker["hostname"] == "worker-{{.Task.Slot}}"
    for svc in (worker, coordinator):
        assert svc["deploy"]["restart_policy"] == {"condition": "none"}
        assert svc["deploy"]["endpoint_mode"] == "dnsrr"
    assert worker["deploy"]["placement"] == {"max_replicas_per_node": 1}
    assert "placement" not in stack_override(2, "wiiide")["services"]["worker"]["deploy"]
    assert over["networks"] == {"wiiide": {"driver": "overlay", "internal": True}}


@pytest.mark.skipif(shutil.which("docker") is None, reason="the docker CLI is not installed")
def test_generated_files_pass_the_stack_loader(tmp_path):
    """`docker stack config` (client side only, no engine) merges the two files as a deploy would."""
    files = write_stack_files(tmp_path, 4)
    env = {**os.environ, "WIIIIIDE_IMAGE": "img:1", "WIIIIIDE_RESULTS_DIR": "/r",
           "WIIIIIDE_SECRET_FILE_HOST": "/s", "WIIIIIDE_WORKER_CPUS": "0.5"}
    out = subprocess.run(["docker", "stack", "config", *(x for f in files for x in ("-c", str(f)))],
                         capture_output=True, text=True, env=env, timeout=60)
    if "unknown command" in out.stderr or "is not a docker command" in out.stderr:
        pytest.skip(f"this docker CLI has no `stack config`: {out.stderr.strip()[:100]}")
    assert out.returncode == 0, out.stderr
    merged = yaml.safe_load(out.stdout)
    worker = merged["services"]["worker"]
    assert worker["deploy"]["replicas"] == 4 and worker["image"] == "img:1"
    assert worker["deploy"]["resources"]["limits"]["cpus"] == "0.5"
    assert worker["volumes"][0]["source"] == "/r"
    assert merged["networks"]["wiiide"]["driver"] == "overlay"


def test_parse_endpoints():
    assert parse_endpoints(" a=ssh://root@a, b=tcp://10.0.0.2:2376 ,") == {
        "a": "ssh://root@a", "b": "tcp://10.0.0.2:2376"}
    assert parse_endpoints("") == {}
    with pytest.raises(ClusterError, match=ENDPOINTS_ENV):
        parse_endpoints("a:ssh://root@a")


class _Nodes:
    def get(self, node_id):
        return type("Node", (), {"attrs": {"Description": {"Hostname": f"host-{node_id}"}}})()


class _Client:
    nodes = _Nodes()

    def info(self):
        return {"Swarm": {"LocalNodeState": "active", "NodeID": "n1", "ControlAvailable": True}}


def test_node_engines_local_node_is_the_local_engine_and_others_need_an_endpoint():
    client = _Client()
    engines = NodeEngines(client, endpoints="")
    assert engines.client_for("n1") is client
    with pytest.raises(ClusterError, match=f"node host-n2.*{ENDPOINTS_ENV}=host-n2=ssh://"):
        engines.client_for("n2")


class _Container:
    name = "wiiide-stack_worker.2.abc123"
    labels = {"com.docker.swarm.service.name": "wiiide-stack_worker"}
    id = "abcdef0123456789"

    def kill(self):
        return "killed"


def test_task_container_looks_like_compose_to_shaping_and_judging():
    c = TaskContainer(_Container(), "wiiide-stack", "worker", 2, "n1", "host-n1")
    assert container_identity(c) == ("worker", 2)
    assert _node_name(c.name) == "worker-2"
    assert c.kill() == "killed" and c.id == _Container.id  # everything else is the container's own
    # a killed worker's exit is the fault's effect when the injector hit it, by this name
    nodes = {"coordinator": {"status": "ok"}, "worker-1": {"status": "ok", "node_id": "worker-1"}}
    assert judge(nodes, {c.name: 137, "wiiide-stack_coordinator_1": 0}, 2, expected_dead={"worker-2"})[0] == "ok"
    assert judge(nodes, {c.name: 137, "wiiide-stack_coordinator_1": 0}, 2)[0] == "failed"


def _tar(files: dict[str, bytes]) -> bytes:
    import io
    import tarfile
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


class _ArchiveContainer:
    name = "stack_worker_1"

    def __init__(self, blob: bytes) -> None:
        self.blob = blob

    def get_archive(self, path):
        assert path == "/results/nodes"
        return iter([self.blob[:100], self.blob[100:]]), {}  # the SDK streams the tar in chunks


def test_copy_node_metrics_keeps_only_metrics_files(tmp_path):
    from harness.run.swarm.tasks import copy_node_metrics
    blob = _tar({"nodes/worker-1.json": b'{"rank": 1}', "nodes/coordinator.training": b"",
                 "nodes/notes.txt": b"x", "nodes/../../evil.json": b"{}"})
    copied = copy_node_metrics(_ArchiveContainer(blob), tmp_path / "nodes")
    assert sorted(copied) == ["coordinator.training", "evil.json", "worker-1.json"]
    assert (tmp_path / "nodes" / "worker-1.json").read_bytes() == b'{"rank": 1}'
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == sorted(copied)  # nothing outside nodes/


class _EthContainer:
    name = "stack_worker_1"

    def __init__(self, address: str, eth0: str) -> None:
        self.attrs = {"NetworkSettings": {"Networks": {"stack_wiiide": {"IPAddress": address}}}}
        self.eth0 = eth0

    def exec_run(self, argv):
        return 0, self.eth0.encode()


def test_overlay_eth0_is_checked_before_shaping():
    from harness.errors import LinkShapingError
    from harness.run.swarm.tasks import check_overlay_eth0
    line = "2: eth0    inet 10.0.1.4/24 brd 10.0.1.255 scope global eth0"
    check_overlay_eth0(_EthContainer("10.0.1.4", line), "stack")
    with pytest.raises(LinkShapingError, match="eth0 does not carry the overlay address 10.0.1.40"):
        check_overlay_eth0(_EthContainer("10.0.1.40", line), "stack")
