"""Tensor memory accounting, CPU autocast and activation checkpointing (`wiiide.tensor_memory`,
`wiiide.training.models.transformer`): sizes worked out by hand from the architectures."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from wiiide.config import RunConfig
from wiiide.errors import ConfigError
from wiiide.training.model import FlatParams
from wiiide.training.models import build_from_spec, loss_mean, set_activation_checkpointing
from wiiide.server.pace.outer import gradient
from wiiide.tensor_memory import (
    ActivationMeter,
    ForwardScope,
    autocast_dtype,
    gradient_bytes,
    optimizer_state_bytes,
    parameter_bytes,
    tensor_memory,
)

F, H, C, B = 8, 16, 4, 5  # features, hidden, classes, batch
# Linear(8, 16) + Linear(16, 4): weights and biases, float32
MLP_PARAM_BYTES = 4 * ((F * H + H) + (H * C + C))  # 848


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(F, H), nn.ReLU(), nn.Linear(H, C))


def test_parameters_gradients_and_momentum_bytes_of_a_known_mlp():
    model = _mlp()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    assert parameter_bytes(model) == MLP_PARAM_BYTES
    assert gradient_bytes(model) == 0 and optimizer_state_bytes(sgd) == 0  # nothing before the first step
    nn.functional.cross_entropy(model(torch.randn(B, F)), torch.zeros(B, dtype=torch.long)).backward()
    sgd.step()
    assert gradient_bytes(model) == MLP_PARAM_BYTES
    assert optimizer_state_bytes(sgd) == MLP_PARAM_BYTES  # one momentum buffer per parameter
    record = tensor_memory(model, sgd, 100)
    assert record["total_bytes"] == 3 * MLP_PARAM_BYTES + 100


def test_views_of_one_flat_vector_count_once():
    model = _mlp()
    flat = FlatParams(model)  # a worker's parameters: views of one float32 vector, as are the gradients
    assert parameter_bytes(model) == MLP_PARAM_BYTES
    record = tensor_memory(model, None, None, gradients=[flat.grads])
    assert record["gradient_bytes"] == MLP_PARAM_BYTES and record["optimizer_state_bytes"] == 0
    assert record["total_bytes"] == 2 * MLP_PARAM_BYTES  # activations not measured: left out


def test_activations_are_what_the_forward_leaves_for_the_backward():
    model, x = _mlp(), torch.randn(B, F)
    meter = ActivationMeter()
    with meter:
        out = model(x)
    # ReLU keeps its output for the backward and the second Linear its input (the same tensor); the
    # first Linear's output is freed once ReLU has read it; the logits are held by `out`
    assert meter.live_bytes(model.parameters()) == 4 * (B * H + B * C)
    del out
    assert meter.live_bytes(model.parameters()) == 0  # the graph went with the output


def _transformer(checkpointing: bool) -> nn.Module:
    model = build_from_spec({"type": "transformer", "layers": 3, "width": 32, "heads": 2, "context": 16}, seed=1)
    set_activation_checkpointing(model, checkpointing)
    return model


def test_activation_checkpointing_gives_the_same_gradients_and_keeps_less():
    x = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(2))
    y = torch.roll(x, -1, dims=1)
    grads, kept = [], []
    for checkpointing in (False, True):
        model = _transformer(checkpointing)
        flat, scope = FlatParams(model), ForwardScope()
        loss = gradient(model, flat, x, y, 1, loss_fn=lambda out, t: loss_mean("transformer", out, t), scope=scope)
        grads.append((loss, flat.grads.clone()))
        kept.append(scope.activation_bytes)
    assert grads[1][0] == pytest.approx(grads[0][0], abs=1e-6)
    torch.testing.assert_close(grads[1][1], grads[0][1], rtol=1e-5, atol=1e-6)
    # without: every block's insides (the 4x-wide MLP, attention, LayerNorms) for 3 blocks; with: each
    # block's (4, 16, 32) float32 input plus what lies outside the blocks
    block_input = 4 * 16 * 32 * 4
    assert kept[0] > 3 * 4 * block_input  # each block keeps at least its 4x-wide MLP activations
    assert kept[1] < kept[0] / 2 and kept[1] >= 3 * block_input


def test_bf16_autocast_runs_the_forward_in_bf16_and_leaves_gradients_float32():
    model = _mlp()
    flat, scope = FlatParams(model), ForwardScope("bf16")
    seen = []
    model[0].register_forward_hook(lambda mod, inp, out: seen.append(out.dtype))
    x, y = torch.randn(B, F), torch.zeros(B, dtype=torch.long)
    loss = gradient(model, flat, x, y, 1, loss_fn=lambda out, t: loss_mean("mlp", out, t), scope=scope)
    assert seen == [torch.bfloat16] and flat.grads.dtype == torch.float32 and flat.params.dtype == torch.float32
    assert loss == pytest.approx(nn.functional.cross_entropy(_mlp()(x), y).item(), rel=0.05)  # bf16: ~3 digits


def test_mixed_precision_and_checkpointing_refusals(monkeypatch):
    with pytest.raises(ValueError, match="unknown mixed_precision"):
        autocast_dtype("fp8")
    with pytest.raises(ValueError, match="transformer only"):
        set_activation_checkpointing(_mlp(), True)
    with pytest.raises(ConfigError, match="activation_checkpointing.*no blocks to recompute"):
        RunConfig(model="mlp", activation_checkpointing=True)
    RunConfig(model="transformer", activation_checkpointing=True, engine="fsdp")
    RunConfig(engine="wiiide", mixed_precision="bf16", ps_shards="all")
    # a torch whose CPU autocast does not take float16 (it warns and stays float32): refused, with why
    monkeypatch.setattr(torch, "get_autocast_dtype", lambda device: torch.float32)
    with pytest.raises(ConfigError, match="CPU autocast does not support torch.float16"):
        RunConfig(mixed_precision="fp16")


def test_the_report_keeps_the_largest_nodes_tensor_memory():
    from harness.results.totals import repeat_totals

    nodes = {"coordinator": {"steps": 4, "tensor_memory": {"total_bytes": 300, "activation_bytes": 20}},
             "worker-1": {"steps": 4, "tensor_memory": {"total_bytes": 500, "activation_bytes": 10}},
             "worker-2": {"steps": 4}}  # a node of an older version: no record
    totals = repeat_totals(nodes, {})
    assert (totals.tensor_bytes_max, totals.activation_bytes_max) == (500, 20)
    assert repeat_totals({"coordinator": {"steps": 4}}, {}).tensor_bytes_max is None


def test_a_storage_at_a_freed_storages_address_is_counted():
    meter = ActivationMeter()
    kept = []
    with meter:  # the allocator hands freed addresses to later tensors of the same size
        for i in range(200):
            t = torch.empty(1024) + i
            if i % 2:
                kept.append(t)
            del t
    assert meter.live_bytes() == 100 * 4 * 1024


def test_the_metered_first_forward_does_not_import_dynamo():
    """A worker's first step (the forward under the activation meter, the backward with per-parameter
    hooks, as `wiiide.ps.client` registers them) in a fresh interpreter leaves torch._dynamo unloaded:
    its import is 1.6-2 s of CPU inside step 0, which stalled the sharded runs' first step."""
    import subprocess
    import sys
    from pathlib import Path

    code = ("import sys, torch\n"
            "from wiiide.training.model import build_mlp, FlatParams\n"
            "from wiiide.server.pace.outer import gradient\n"
            "from wiiide.tensor_memory import ForwardScope\n"
            "m = build_mlp(8, [16], 4, seed=0); f = FlatParams(m); scope = ForwardScope('none')\n"
            "seen = []\n"
            "[p.register_post_accumulate_grad_hook(lambda p: seen.append(p.numel())) for p in m.parameters()]\n"
            "gradient(m, f, torch.randn(5, 8), torch.zeros(5, dtype=torch.long), 1, scope=scope)\n"
            "print(scope.activation_bytes > 0, len(seen), 'torch._dynamo' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[2]).stdout
    assert out.split() == ["True", "4", "False"]  # measured, every hook ran, and no Dynamo
