"""Mixed precision on the wiiide workers and activation checkpointing on every engine, on loopback: the
runs train, and every worker and rank records its tensor memory."""

from __future__ import annotations

import pytest

from tests.integration.local_run import run_nodes
from tests.unit.conftest import free_port, node_env, node_procs  # noqa: F401  (fixtures)

TINY_LM = {"model": "transformer", "transformer_layers": 2, "transformer_width": 32, "transformer_heads": 2,
           "transformer_context": 32, "batch_size": 8}


def test_bf16_autocast_on_wiiide_workers_trains(tmp_path, node_env, node_procs):  # noqa: F811
    nodes = run_nodes(node_env, node_procs, tmp_path / "bf16", {
        "num_workers": 2, "hidden_sizes": "32", "max_steps": 40, "duration_s": 120, "learning_rate": 0.2,
        "mixed_precision": "bf16"})
    summary = nodes["coordinator"]["training_summary"]
    assert summary["final_loss"] < summary["avg_loss"] and summary["final_loss"] < 1.5  # from ln(10) = 2.3 nats
    for name in ("worker-1", "worker-2"):
        worker = nodes[name]
        assert worker["mixed_precision"] == "bf16", name
        memory = worker["tensor_memory"]
        assert memory["parameter_bytes"] == memory["gradient_bytes"] == 4 * nodes["coordinator"]["num_parameters"]
        assert memory["optimizer_state_bytes"] == 0 and memory["activation_bytes"] > 0, name


@pytest.mark.parametrize("fields", [
    {"engine": "wiiide", "ps_shards": "all", "mixed_precision": "bf16"},
    {"engine": "fsdp"},  # ddp runs the same model code; fsdp also re-gathers each block to recompute it
], ids=["wiiide-shards-bf16", "fsdp"])
def test_activation_checkpointing_trains_on_every_engine(tmp_path, node_env, node_procs, fields):  # noqa: F811
    nodes = run_nodes(node_env, node_procs, tmp_path / fields["engine"], {
        "num_workers": 2, "max_steps": 6, "duration_s": 120, "activation_checkpointing": True, **TINY_LM, **fields})
    for name, node in nodes.items():
        assert node["steps"] == 6, name
        if name != "coordinator" or fields["engine"] != "wiiide":
            assert node["activation_checkpointing"] is True, name
            assert node["tensor_memory"]["activation_bytes"] > 0, name
