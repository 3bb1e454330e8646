"""`harness.run.compose_project.cluster_down` against a fake engine: what it says when a network stays."""

from __future__ import annotations

import pytest

from harness.errors import ClusterError
from harness.run import compose_project as compose


class _APIError(Exception):
    """Stands for docker.errors.APIError (only its text is read)."""


class _Network:
    def __init__(self, name: str, error: str | None) -> None:
        self.name, self.error = name, error

    def remove(self) -> None:
        if self.error:
            raise _APIError(self.error)


class _Client:
    def __init__(self, network: _Network) -> None:
        self.networks = self
        self.network = network

    def list(self, filters=None) -> list:
        return [self.network]


def _down_with(monkeypatch, error: str) -> str:
    monkeypatch.setattr(compose, "docker_client", lambda: _Client(_Network("wiiide_wiiide", error)))
    monkeypatch.setattr(compose, "project_containers", lambda client=None: [])
    lines: list[str] = []
    with pytest.raises(ClusterError) as raised:
        compose.cluster_down(progress=lines.append)
    assert lines and "wiiide_wiiide" in lines[0]
    return str(raised.value)


def test_a_stale_endpoint_gets_the_engine_restart_as_its_remedy(monkeypatch):
    """dockerd refused the network for an endpoint of a container already gone (dockerd 20.10): the error
    names the network, gives the engine's words, and says to restart the engine."""
    message = _down_with(monkeypatch, '403 Client Error: Forbidden ("error while removing network: network '
                                      'wiiide_wiiide id 87cb has active endpoints")')
    assert "network wiiide_wiiide of project" in message and "has active endpoints" in message
    assert "restart it" in message and "make docker-engine-stop docker-engine" in message


def test_another_error_gets_no_such_remedy(monkeypatch):
    message = _down_with(monkeypatch, "500 Server Error: something else")
    assert "something else" in message and "restart" not in message
