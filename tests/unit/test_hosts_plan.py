"""The hosts' plan (harness.hosts.plan): names, labels and container settings of `hosts up`, the spread of
a stack's workers over the hosts, and the refusal of a bad host count (from the command line too)."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.cli import main
from harness.errors import SpecError
from harness.hosts.plan import (
    CAPABILITIES,
    INDEX_LABEL,
    LABEL,
    MAX_HOSTS,
    ROLE_LABEL,
    HostsPlan,
    max_replicas_per_node,
    parse_host_count,
    split_tag,
)


@pytest.mark.parametrize("value", ["0", "-1", "x", "2.5", "", str(MAX_HOSTS + 1), 0, -3])
def test_a_bad_host_count_is_refused_naming_the_range(value):
    with pytest.raises(SpecError, match=f"1.*{MAX_HOSTS}"):
        parse_host_count(value)


@pytest.mark.parametrize("value, count", [("1", 1), (" 3 ", 3), (MAX_HOSTS, MAX_HOSTS)])
def test_a_good_host_count_is_read(value, count):
    assert parse_host_count(value) == count


@pytest.mark.parametrize("argv", [["hosts", "up", "--hosts", "0"], ["hosts", "up", "--hosts", "-1"],
                                  ["hosts", "up", "--hosts", "x"], ["hosts", "up", "--hosts", "99"]])
def test_hosts_up_refuses_a_bad_count_before_anything_starts(argv, capsys, monkeypatch):
    def no_engine(*args, **kwargs):
        raise AssertionError("an engine was asked for")
    monkeypatch.setattr("harness.run.docker_client.docker_client", no_engine)
    assert main(argv) == 2
    assert "--hosts" in capsys.readouterr().err


def test_hosts_flag_needs_the_swarm_backend(capsys):
    assert main(["sweep", "experiments/quick.yaml", "--hosts", "--backend", "docker", "--dry-run"]) == 2
    assert "--backend swarm" in capsys.readouterr().err


def test_plan_names_labels_and_manager_first(tmp_path):
    plan = HostsPlan("proj", 3, socket_root=tmp_path)
    hosts = plan.hosts
    assert [h.name for h in hosts] == ["proj-host-1", "proj-host-2", "proj-host-3"]
    assert len({h.volume for h in hosts} | {plan.registry_volume}) == 4  # one volume each, none shared
    assert hosts[0].docker_url == f"unix://{tmp_path}/proj/host-1/docker.sock"
    assert plan.labels("host", 2) == {LABEL: "proj", ROLE_LABEL: "host", INDEX_LABEL: "2"}
    assert plan.labels("registry") == {LABEL: "proj", ROLE_LABEL: "registry"}


def test_host_container_runs_its_own_dockerd_on_a_volume_trusting_the_registry(tmp_path):
    plan = HostsPlan("proj", 2, socket_root=tmp_path)
    host = plan.hosts[1]
    create, host_config = plan.host_container(host, "wiiide-host:abc")
    cmd = create["command"]
    assert cmd[0] == "dockerd"
    assert cmd[cmd.index("--insecure-registry") + 1] == "proj-registry:5000" == plan.registry_address
    assert create["hostname"] == create["name"] == "proj-host-2"  # the swarm node's name
    assert create["labels"][INDEX_LABEL] == "2"
    assert host_config["binds"][host.volume]["bind"] == "/var/lib/docker"
    assert host_config["binds"][str(host.socket_dir)]["bind"] == "/run/wiiide-host"
    assert host_config["network_mode"] == plan.network
    assert "NET_ADMIN" in host_config["cap_add"] and "SYS_ADMIN" in host_config["cap_add"]
    assert "SYS_RESOURCE" not in CAPABILITIES  # refused by an engine without it; --privileged would ask for it
    assert host_config["raw"] == {"MaskedPaths": [], "ReadonlyPaths": []}


def test_registry_is_published_on_loopback_only():
    run = HostsPlan("proj", 1).registry_container("wiiide-host:abc")
    assert run["ports"] == {"5000/tcp": ("127.0.0.1", None)}
    assert run["entrypoint"] == ["docker-registry"] and run["network"] == "proj-hosts"


@pytest.mark.parametrize("image, address, ref", [
    ("wiiide:hosts", None, "proj-registry:5000/wiiide:hosts"),
    ("wiiide", "127.0.0.1:5123", "127.0.0.1:5123/wiiide:latest"),
    ("reg.example:5000/team/wiiide:v1", None, "proj-registry:5000/wiiide:v1"),
])
def test_image_in_registry(image, address, ref):
    assert HostsPlan("proj", 1).image_in_registry(image, address) == ref


def test_split_tag_reads_a_port_as_no_tag():
    assert split_tag("reg:5000/wiiide") == ("reg:5000/wiiide", "latest")
    assert split_tag("reg:5000/wiiide:t") == ("reg:5000/wiiide", "t")


@pytest.mark.parametrize("workers, hosts, cap", [(2, 2, 1), (4, 3, 2), (4, 1, 4), (1, 3, 1), (8, 3, 3)])
def test_workers_cap_per_host_is_the_smallest_that_holds_them_all(workers, hosts, cap):
    assert max_replicas_per_node(workers, hosts) == cap
    assert cap * hosts >= workers > (cap - 1) * hosts


def test_host_image_tag_follows_its_inputs(monkeypatch, tmp_path):
    import harness.hosts.image as image
    for name in image.INPUTS:
        (tmp_path / name).write_text("a")
    monkeypatch.setattr(image, "CONTEXT", tmp_path)
    first = image.host_image_tag("base:1")
    assert first.startswith("wiiide-host:") and first == image.host_image_tag("base:1")
    assert image.host_image_tag("base:2") != first
    (tmp_path / image.INPUTS[1]).write_text("b")
    assert image.host_image_tag("base:1") != first
    assert Path(image.CONTEXT / image.DOCKERFILE).exists()


def test_stack_on_the_hosts_caps_workers_per_host(tmp_path, monkeypatch):
    import yaml

    from harness.run.swarm.stack import MAX_PER_NODE_ENV, write_stack_files
    monkeypatch.delenv(MAX_PER_NODE_ENV, raising=False)
    _, override = write_stack_files(tmp_path, 4, max_replicas_per_node=max_replicas_per_node(4, 3))
    worker = yaml.safe_load(override.read_text())["services"]["worker"]["deploy"]
    assert worker["replicas"] == 4 and worker["placement"] == {"max_replicas_per_node": 2}
    _, override = write_stack_files(tmp_path, 4)
    assert "placement" not in yaml.safe_load(override.read_text())["services"]["worker"]["deploy"]


@pytest.mark.parametrize("config, says", [
    ({"CONFIG_INET_ESP": "not set", "CONFIG_CRYPTO_GCM": "y"}, "lacks CONFIG_INET_ESP: "),
    ({"CONFIG_INET_ESP": "m", "CONFIG_CRYPTO_GCM": "y"}, "has ESP and GCM"),
    (None, "unknown"),
])
def test_the_encryption_probe_names_what_the_kernel_lacks(config, says, monkeypatch):
    import harness.bench.overlay as overlay
    from harness.hosts.engines import encryption_note
    monkeypatch.setattr(overlay, "kernel_ipsec", lambda: {"config": config, "xfrm_stat": None})
    assert says in encryption_note()
