"""``compose.yaml`` read as the one description of the cluster's services, turned into Engine API
arguments, so that the docker backend starts the containers itself, in parallel, as Compose would.

Why not ``docker-compose up --scale worker=N``: measured with ``wiiide-lab bench-overhead``, Compose
v1 took 13-17 s to bring up 1+8 containers (it waits for the coordinator's healthcheck before it
creates any worker, then creates the workers through its own Python client), while the Engine API
does it in a few seconds. The file stays valid for Compose, and the containers carry Compose's
labels (project, service, container number), so ``docker-compose -p PROJECT ps``/``down`` and the
harness's own teardown (by label) see them.

What is read, per service: ``image``, ``command``, ``hostname``, ``environment``, ``cap_add``,
``volumes`` (bind mounts ``HOST:CONTAINER[:ro]``), ``secrets`` (bind-mounted read-only at
``/run/secrets/NAME``, as Compose does without Swarm), ``cpus``, ``mem_limit``, ``healthcheck``,
``networks`` (one bridge network, the service name as DNS alias) and ``restart``. Read by Compose
only: ``expose`` (a user-defined bridge needs no exposed port), ``depends_on`` (the harness starts the
coordinator first; workers retry connecting for ``connect_timeout_s``) and ``stop_grace_period``
(the harness stops with its own grace, `harness.run.compose_project.DOWN_GRACE_S`). Variables are substituted as Compose does: ``${VAR}``, ``${VAR:-default}`` (default also
when empty) and ``${VAR-default}`` (only when unset). Anything else in a service is refused with a
`ClusterError`, so that a key added to compose.yaml is never silently ignored.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import yaml

from harness.errors import ClusterError
from wiiide.units import UnitError, parse_size_bytes, parse_time_s

PROJECT_LABEL = "com.docker.compose.project"
SERVICE_LABEL = "com.docker.compose.service"
NUMBER_LABEL = "com.docker.compose.container-number"
NETWORK_LABEL = "com.docker.compose.network"
ONEOFF_LABEL = "com.docker.compose.oneoff"

KNOWN_SERVICE_KEYS = {"image", "command", "hostname", "environment", "cap_add", "volumes", "secrets", "cpus",
                      "mem_limit", "healthcheck", "networks", "restart",
                      "expose", "depends_on", "stop_grace_period"}  # the last three: for Compose only
_VARIABLE = re.compile(r"\$\{(\w+)(?:(:?-)([^}]*))?\}")


def substitute(value: Any, env: Mapping[str, str]) -> Any:
    """Replace ``${VAR}``, ``${VAR:-default}`` and ``${VAR-default}`` in every string of `value`
    (nested dicts and lists too) from `env`, as Compose does; an unset ``${VAR}`` becomes ``""``."""
    if isinstance(value, str):
        def one(match: re.Match) -> str:
            name, op, default = match.group(1), match.group(2), match.group(3)
            current = env.get(name)
            if op == ":-" and not current:
                return default
            if op == "-" and current is None:
                return default
            return current or ""
        return _VARIABLE.sub(one, value)
    if isinstance(value, dict):
        return {k: substitute(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [substitute(v, env) for v in value]
    return value


@dataclass(frozen=True)
class ComposeProject:
    """compose.yaml after substitution: its services, its one network and its secrets.

    `base_dir` is the folder relative paths (``./results/cluster``) are resolved against.
    """

    name: str
    services: dict[str, dict[str, Any]]
    network: str
    secrets: dict[str, Path]
    base_dir: Path

    @property
    def network_name(self) -> str:
        """The Engine API name of the project's network, as Compose names it: ``<project>_<network>``."""
        return f"{self.name}_{self.network}"

    def container_name(self, service: str, number: int) -> str:
        """``<project>_<service>_<number>``, Compose v1's container names."""
        return f"{self.name}_{service}_{number}"

    def labels(self, service: str | None = None, number: int | None = None) -> dict[str, str]:
        """Compose's labels: the project, and for a container its service and number."""
        labels = {PROJECT_LABEL: self.name}
        if service is not None:
            labels.update({SERVICE_LABEL: service, NUMBER_LABEL: str(number), ONEOFF_LABEL: "False"})
        return labels

    def create_kwargs(self, service: str, number: int) -> dict[str, Any]:
        """Keyword arguments of ``client.containers.create`` for container `number` (from 1) of
        `service`, attached to `network_name` with the service name as DNS alias.

        Raises:
            ClusterError: an unknown service or key, or a value that cannot be read (naming it).
        """
        try:
            svc = self.services[service]
        except KeyError:
            raise ClusterError(f"compose.yaml has no service {service!r}; it has {sorted(self.services)}") from None
        where = f"compose.yaml: services.{service}"
        unknown = sorted(set(svc) - KNOWN_SERVICE_KEYS)
        if unknown:
            raise ClusterError(f"{where}.{unknown[0]}: not understood by harness.run.compose_file; "
                               f"known keys: {', '.join(sorted(KNOWN_SERVICE_KEYS))}")
        kwargs: dict[str, Any] = {
            "image": svc["image"], "command": svc.get("command"), "name": self.container_name(service, number),
            "labels": self.labels(service, number), "detach": True,
            "environment": {str(k): "" if v is None else str(v) for k, v in (svc.get("environment") or {}).items()},
            "cap_add": list(svc.get("cap_add") or []), "network": self.network_name,
        }
        if svc.get("hostname"):
            kwargs["hostname"] = svc["hostname"]
        restart = str(svc.get("restart") or "no")
        if restart != "no":
            kwargs["restart_policy"] = {"Name": restart}
        binds = [self._bind(spec, f"{where}.volumes") for spec in svc.get("volumes") or []]
        for secret in svc.get("secrets") or []:
            if secret not in self.secrets:
                raise ClusterError(f"{where}.secrets: {secret!r} is not under the top-level secrets")
            binds.append(f"{self.secrets[secret]}:/run/secrets/{secret}:ro")
        kwargs["volumes"] = binds
        try:
            cpus = float(svc.get("cpus") or 0)
            if cpus:
                kwargs["nano_cpus"] = int(round(cpus * 1e9))
            mem = parse_size_bytes(svc.get("mem_limit") or 0, f"{where}.mem_limit")
            if mem:
                kwargs["mem_limit"] = mem
            if svc.get("healthcheck"):
                hc = svc["healthcheck"]
                kwargs["healthcheck"] = {
                    "test": hc["test"], "retries": int(hc.get("retries", 3)),
                    "interval": int(parse_time_s(hc.get("interval", "30s"), f"{where}.healthcheck.interval") * 1e9),
                    "timeout": int(parse_time_s(hc.get("timeout", "30s"), f"{where}.healthcheck.timeout") * 1e9)}
        except (UnitError, ValueError, KeyError) as exc:
            raise ClusterError(f"{where}: {exc}") from None
        return kwargs

    def _bind(self, spec: str, where: str) -> str:
        """``HOST:CONTAINER[:MODE]`` with HOST made absolute against `base_dir`."""
        parts = str(spec).split(":")
        if len(parts) not in (2, 3) or not parts[0]:
            raise ClusterError(f"{where}: {spec!r}: expected HOST:CONTAINER[:ro|rw] (a bind mount)")
        host = Path(parts[0])
        parts[0] = str(host if host.is_absolute() else (self.base_dir / host).resolve())
        return ":".join(parts)


def load_project(path: Path, project: str, env: Mapping[str, str]) -> ComposeProject:
    """Read `path` (compose.yaml), substitute `env` into it and return the project `project`.

    Raises:
        ClusterError: the file cannot be read, or does not have exactly one network.
    """
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ClusterError(f"{path}: cannot read: {exc}") from None
    data = substitute({k: v for k, v in data.items() if not str(k).startswith("x-")}, env)
    networks = list((data.get("networks") or {}))
    if len(networks) != 1:
        raise ClusterError(f"{path}: networks: the harness runs one bridge network; found {networks or 'none'}")
    base_dir = path.parent
    secrets = {}
    for name, spec in (data.get("secrets") or {}).items():
        file = Path((spec or {}).get("file", ""))
        secrets[name] = file if file.is_absolute() else (base_dir / file).resolve()
    return ComposeProject(project, dict(data.get("services") or {}), networks[0], secrets, base_dir)
