"""What ``hosts up`` creates, as pure data: the names, labels and container settings of N host
containers, their network and the registry, and how a stack's workers spread over the hosts.

Nothing here talks to an engine; `harness.hosts.engines` carries the plan out and
tests/unit/test_hosts_plan.py checks it.
"""

from __future__ import annotations

import math
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.errors import SpecError

HOSTS_ENV = "WIIIIIDE_SWARM_HOSTS"  # "1": the swarm backend runs on the hosts of `hosts up` (--hosts)
MAX_HOSTS = 8  # each host is a dockerd (~60 MB resident) plus its tasks; 2 cores hold no more usefully
LABEL = "io.wiiide.hosts"  # on every container, volume and network of the hosts: value = the project
ROLE_LABEL = "io.wiiide.hosts.role"  # "host" or "registry"
INDEX_LABEL = "io.wiiide.hosts.index"  # 1..N on a host container; 1 is the swarm manager
REGISTRY_PORT = 5000  # the distribution registry's port (its config in the host image: /etc/wiiide/registry.yml)
REGISTRY_CONFIG = "/etc/wiiide/registry.yml"
SOCKET_DIR = "/run/wiiide-host"  # inside a host: where its dockerd's socket is (bind-mounted from outside)
SOCKET_NAME = "docker.sock"
# What --privileged would grant, less CAP_SYS_RESOURCE: an engine whose own bounding set lacks a
# capability refuses --privileged ("unable to apply caps"), as on the machines this project is tested
# on. Docker 20.10 knows no BPF, PERFMON or CHECKPOINT_RESTORE. The inner dockerd hands its tasks the
# default set plus NET_ADMIN (tc), all of which are here.
CAPABILITIES = ("AUDIT_CONTROL", "AUDIT_READ", "AUDIT_WRITE", "BLOCK_SUSPEND", "CHOWN", "DAC_OVERRIDE",
                "DAC_READ_SEARCH", "FOWNER", "FSETID", "IPC_LOCK", "IPC_OWNER", "KILL", "LEASE",
                "LINUX_IMMUTABLE", "MAC_ADMIN", "MAC_OVERRIDE", "MKNOD", "NET_ADMIN", "NET_BIND_SERVICE",
                "NET_BROADCAST", "NET_RAW", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYSLOG", "SYS_ADMIN",
                "SYS_BOOT", "SYS_CHROOT", "SYS_MODULE", "SYS_NICE", "SYS_PACCT", "SYS_PTRACE", "SYS_RAWIO",
                "SYS_TIME", "SYS_TTY_CONFIG", "WAKE_ALARM")
# seccomp and AppArmor off, and (`host_container`'s empty MaskedPaths / ReadonlyPaths, the CLI's
# `--security-opt systempaths=unconfined`) /proc and /sys unmasked: what --privileged also does (dockerd
# mounts, makes bridges and VXLAN devices, writes /proc/sys); the host's entry point remounts /sys and cgroups rw.
SECURITY_OPT = ("seccomp=unconfined", "apparmor=unconfined")


def parse_host_count(value: object) -> int:
    """`value` (``--hosts``: a string or int) as a number of hosts, 1..`MAX_HOSTS`.

    Raises:
        SpecError: not a whole number, below 1, or above `MAX_HOSTS` (the message names the range).
    """
    text = str(value).strip()
    try:
        count = int(text)
    except ValueError:
        raise SpecError(f"--hosts {value!r}: expected a whole number of hosts, 1..{MAX_HOSTS}") from None
    if not 1 <= count <= MAX_HOSTS:
        raise SpecError(f"--hosts {count}: a number of hosts from 1 to {MAX_HOSTS} (each is a dockerd in a "
                        f"container on this machine)")
    return count


def max_replicas_per_node(num_workers: int, num_hosts: int) -> int:
    """``deploy.placement.max_replicas_per_node`` of the workers on `num_hosts` hosts: ceil(workers /
    hosts), the smallest cap that holds them all. Swarm's spread strategy then balances the rest (2
    workers on 2 hosts: 1 each, forced; 4 on 3: 2, 1, 1 as spread places them).

    Raises:
        ValueError: fewer than 1 worker or host."""
    if num_workers < 1 or num_hosts < 1:
        raise ValueError(f"need >= 1 worker and host, got {num_workers} and {num_hosts}")
    return math.ceil(num_workers / num_hosts)


@dataclass(frozen=True)
class HostSpec:
    """One host: container `name` (also its hostname, and so the swarm node's name), 1-based `index`
    (1: the manager), the `volume` on its /var/lib/docker, and `socket_dir` on this machine where its
    dockerd's socket appears."""

    name: str
    index: int
    volume: str
    socket_dir: Path

    @property
    def docker_url(self) -> str:
        """The Engine API of this host's dockerd, as DOCKER_HOST takes it (``unix:///.../docker.sock``)."""
        return f"unix://{self.socket_dir / SOCKET_NAME}"


@dataclass(frozen=True)
class HostsPlan:
    """Everything ``hosts up`` makes for `project` with `count` hosts (see the module docstring)."""

    project: str
    count: int
    socket_root: Path = Path(tempfile.gettempdir()) / "wiiide-hosts"

    @property
    def network(self) -> str:
        """The hosts' own bridge network (their "LAN": the swarm's control and VXLAN traffic)."""
        return f"{self.project}-hosts"

    @property
    def registry(self) -> str:
        """The registry container's name; the hosts reach it by this name on `network`."""
        return f"{self.project}-registry"

    @property
    def registry_volume(self) -> str:
        return f"{self.project}-registry-data"

    @property
    def registry_address(self) -> str:
        """``HOST:PORT`` of the registry as the hosts see it (in their dockerd's insecure-registries)."""
        return f"{self.registry}:{REGISTRY_PORT}"

    @property
    def hosts(self) -> list[HostSpec]:
        """The hosts, manager first."""
        return [HostSpec(f"{self.project}-host-{i}", i, f"{self.project}-host-{i}-docker",
                         self.socket_root / self.project / f"host-{i}") for i in range(1, self.count + 1)]

    def labels(self, role: str, index: int | None = None) -> dict[str, str]:
        """The labels of an object of role ``host``, ``registry`` or ``network``."""
        return {LABEL: self.project, ROLE_LABEL: role, **({INDEX_LABEL: str(index)} if index else {})}

    def dockerd_command(self) -> list[str]:
        """A host's dockerd: its API only on the bind-mounted socket, the registry as an insecure
        (plain HTTP) one, and address pools clear of the outer engine's 172.17-31/16 bridges."""
        return ["dockerd", "-H", f"unix://{SOCKET_DIR}/{SOCKET_NAME}", "--insecure-registry", self.registry_address,
                "--default-address-pool", "base=192.168.128.0/17,size=24"]

    def host_container(self, host: HostSpec, image: str) -> tuple[dict[str, Any], dict[str, Any]]:
        """The Engine API's create request for `host`, as (keyword arguments of the docker SDK's
        ``api.create_container`` without ``host_config``, keyword arguments of ``api.create_host_config``,
        plus the keys the SDK has no argument for: ``MaskedPaths``, ``ReadonlyPaths``)."""
        create = {"image": image, "command": self.dockerd_command(), "name": host.name, "hostname": host.name,
                  "detach": True, "labels": self.labels("host", host.index)}
        host_config = {"cap_add": list(CAPABILITIES), "security_opt": list(SECURITY_OPT), "network_mode": self.network,
                       "binds": {host.volume: {"bind": "/var/lib/docker", "mode": "rw"},
                                 str(host.socket_dir): {"bind": SOCKET_DIR, "mode": "rw"}},
                       "raw": {"MaskedPaths": [], "ReadonlyPaths": []}}
        return create, host_config

    def registry_container(self, image: str) -> dict[str, Any]:
        """Keyword arguments of ``client.containers.run`` for the registry: Debian's docker-registry,
        its port published on 127.0.0.1 only (an ephemeral port: the outer engine pushes there, and
        127.0.0.0/8 is a registry Docker allows over plain HTTP without configuration)."""
        return {"image": image, "entrypoint": ["docker-registry"], "command": ["serve", REGISTRY_CONFIG],
                "name": self.registry, "hostname": self.registry, "detach": True, "network": self.network,
                "labels": self.labels("registry"), "ports": {f"{REGISTRY_PORT}/tcp": ("127.0.0.1", None)},
                "volumes": {self.registry_volume: {"bind": "/var/lib/docker-registry", "mode": "rw"}}}

    def image_in_registry(self, image: str, address: str | None = None) -> str:
        """The node image `image` (``repo:tag``) as a reference in the registry at `address` (default:
        `registry_address`, as the hosts pull it): ``wiiide:x`` -> ``<project>-registry:5000/wiiide:x``."""
        repo, tag = split_tag(image)
        return f"{address or self.registry_address}/{repo.rsplit('/', 1)[-1]}:{tag}"


def split_tag(image: str) -> tuple[str, str]:
    """``"repo:tag"`` -> ``("repo", "tag")``; no tag (a colon, if any, is a registry's port) -> ``"latest"``."""
    repo, sep, tag = image.rpartition(":")
    if not sep or "/" in tag:
        return image, "latest"
    return repo, tag
