"""compose.yaml read into Engine API arguments (harness.run.compose_file): substitution as Compose does
it, Compose's names and labels, bind mounts, the secret, limits and the healthcheck; unknown keys refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness import REPO_ROOT
from harness.errors import ClusterError
from harness.run.compose_file import load_project, substitute


def test_substitution_follows_compose():
    env = {"SET": "x", "EMPTY": ""}
    assert substitute("${SET:-d} ${EMPTY:-d} ${UNSET:-d}", env) == "x d d"
    assert substitute("${SET-d} ${EMPTY-d} ${UNSET-d}", env) == "x  d"
    assert substitute({"a": ["${SET}", 3]}, env) == {"a": ["x", 3]}
    assert substitute("${UNSET}", env) == ""


def _project(**env):
    return load_project(REPO_ROOT / "compose.yaml", "proj", {"WIIIIIDE_RESULTS_DIR": "/tmp/res",
                                                             "WIIIIIDE_IMAGE": "img:1", **env})


def test_coordinator_arguments_match_compose_yaml():
    project = _project(WIIIIIDE_NUM_WORKERS="4", WIIIIIDE_SECRET_FILE_HOST="/tmp/secret")
    kw = project.create_kwargs("coordinator", 1)
    assert kw["name"] == "proj_coordinator_1" and kw["image"] == "img:1" and kw["hostname"] == "coordinator"
    assert kw["command"] == ["python", "-m", "wiiide", "coordinator"]
    assert kw["labels"] == {"com.docker.compose.project": "proj", "com.docker.compose.service": "coordinator",
                            "com.docker.compose.container-number": "1", "com.docker.compose.oneoff": "False"}
    assert kw["network"] == project.network_name == "proj_wiiide"
    assert kw["environment"]["WIIIIIDE_NUM_WORKERS"] == "4"
    assert kw["environment"]["WIIIIIDE_BIND_HOST"] == "0.0.0.0"
    assert kw["environment"]["WIIIIIDE_START_GATE_FILE"] == ""  # unset: start at once
    assert kw["cap_add"] == ["NET_ADMIN"]
    assert kw["volumes"] == ["/tmp/res:/results", "/tmp/secret:/run/secrets/wiiide_secret:ro"]
    assert kw["healthcheck"]["interval"] == 1_000_000_000 and kw["healthcheck"]["retries"] == 120
    assert "nano_cpus" not in kw and "mem_limit" not in kw  # 0: no limit


def test_worker_limits_and_relative_paths():
    project = _project(WIIIIIDE_WORKER_CPUS="0.5", WIIIIIDE_WORKER_MEM_LIMIT="512MiB", WIIIIIDE_RESULTS_DIR="")
    kw = project.create_kwargs("worker", 3)
    assert kw["name"] == "proj_worker_3" and kw["labels"]["com.docker.compose.container-number"] == "3"
    assert "hostname" not in kw  # a worker's node id is its container's own hostname
    assert kw["nano_cpus"] == 500_000_000 and kw["mem_limit"] == 512 * 2**20
    assert kw["volumes"][0] == f"{(REPO_ROOT / 'results' / 'cluster').resolve()}:/results"


def test_unknown_service_key_is_refused(tmp_path: Path):
    text = (REPO_ROOT / "compose.yaml").read_text().replace("    hostname: coordinator\n",
                                                            "    hostname: coordinator\n    privileged: true\n")
    (tmp_path / "compose.yaml").write_text(text)
    project = load_project(tmp_path / "compose.yaml", "p", {})
    with pytest.raises(ClusterError, match="services.coordinator.privileged: not understood"):
        project.create_kwargs("coordinator", 1)
    with pytest.raises(ClusterError, match="no service 'ps'"):
        project.create_kwargs("ps", 1)


def test_an_empty_shard_congestion_is_kept_and_an_unset_one_is_auto():
    """shard_tcp_congestion '' (as tcp_congestion) is a choice of its own, not the default: compose.yaml
    uses ``${VAR-auto}``, which only an unset variable turns into auto (a run with '' in
    its spec ran Reno under ``${VAR:-auto}``, its workers' ps.tcp_congestion said so)."""
    assert _project(WIIIIIDE_SHARD_TCP_CONGESTION="").create_kwargs("worker", 1)["environment"][
        "WIIIIIDE_SHARD_TCP_CONGESTION"] == ""
    assert _project().create_kwargs("worker", 1)["environment"]["WIIIIIDE_SHARD_TCP_CONGESTION"] == "auto"
