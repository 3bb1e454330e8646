"""DDP's find_unused_parameters on loopback: the ranks train with it on and record it."""

from __future__ import annotations

from tests.integration.local_run import run_nodes
from tests.unit.conftest import free_port, node_env, node_procs  # noqa: F401  (fixtures)


def test_ddp_trains_with_find_unused_parameters(tmp_path, node_env, node_procs):  # noqa: F811
    nodes = run_nodes(node_env, node_procs, tmp_path / "ddp", {
        "engine": "ddp", "num_workers": 2, "hidden_sizes": "32", "max_steps": 8, "duration_s": 120,
        "ddp_find_unused_parameters": True})
    assert len(nodes) == 3
    for name, node in nodes.items():
        assert node["steps"] == 8 and node["ddp_find_unused_parameters"] is True, name
