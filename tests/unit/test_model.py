"""wiiide.training.model: the MLP, its JSON description, and flat parameter/gradient vectors."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from torch import nn

from wiiide.training.model import (
    FlatParams,
    build_mlp,
    evaluate,
    model_from_spec,
    model_spec,
    num_parameters,
)


def batch(features: int = 64, n: int = 16, classes: int = 10, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, features, generator=g), torch.randint(0, classes, (n,), generator=g)


def test_parameter_count_from_docstring():
    assert num_parameters(build_mlp(64, [64], 10, seed=0)) == 64 * 64 + 64 + 64 * 10 + 10 == 4810


def test_build_mlp_layers_and_seed():
    m = build_mlp(20, [8, 4], 3, seed=1)
    linears = [layer for layer in m if isinstance(layer, nn.Linear)]
    assert [(l.in_features, l.out_features) for l in linears] == [(20, 8), (8, 4), (4, 3)]
    assert sum(isinstance(layer, nn.ReLU) for layer in m) == 2
    same = build_mlp(20, [8, 4], 3, seed=1)
    other = build_mlp(20, [8, 4], 3, seed=2)
    assert all(torch.equal(a, b) for a, b in zip(m.parameters(), same.parameters()))
    assert not all(torch.equal(a, b) for a, b in zip(m.parameters(), other.parameters()))
    assert m(torch.zeros(5, 20)).shape == (5, 3)


def test_spec_roundtrip_builds_same_architecture():
    spec = model_spec(64, (32, 16), 10)
    assert spec == {"type": "mlp", "num_features": 64, "hidden_sizes": [32, 16], "num_classes": 10}
    built = model_from_spec(spec)
    ref = build_mlp(64, [32, 16], 10, seed=0)
    assert [p.shape for p in built.parameters()] == [p.shape for p in ref.parameters()]


@pytest.mark.parametrize("spec", [
    {},
    {"type": "cnn", "num_features": 4, "hidden_sizes": [4], "num_classes": 2},
    {"num_features": 4, "hidden_sizes": [4], "num_classes": 2},
    {"type": "mlp", "hidden_sizes": [4], "num_classes": 2},
    {"type": "mlp", "num_features": 4, "num_classes": 2},
    {"type": "mlp", "num_features": 4, "hidden_sizes": [4]},
    {"type": "mlp", "num_features": 0, "hidden_sizes": [4], "num_classes": 2},
    {"type": "mlp", "num_features": 4, "hidden_sizes": [4], "num_classes": 0},
    {"type": "mlp", "num_features": 2_000_000, "hidden_sizes": [4], "num_classes": 2},
    {"type": "mlp", "num_features": 4, "hidden_sizes": [], "num_classes": 2},
    {"type": "mlp", "num_features": 4, "hidden_sizes": [0], "num_classes": 2},
    {"type": "mlp", "num_features": 4, "hidden_sizes": [-3], "num_classes": 2},
    {"type": "mlp", "num_features": 4, "hidden_sizes": [70000], "num_classes": 2},
    {"type": "mlp", "num_features": 4, "hidden_sizes": [4] * 17, "num_classes": 2},
    {"type": "mlp", "num_features": 4, "hidden_sizes": None, "num_classes": 2},
    {"type": "mlp", "num_features": 4, "hidden_sizes": 4, "num_classes": 2},
    {"type": "mlp", "num_features": "four", "hidden_sizes": [4], "num_classes": 2},
    {"type": "mlp", "num_features": None, "hidden_sizes": [4], "num_classes": 2},
    {"type": "mlp", "num_features": 4, "hidden_sizes": [{"a": 1}], "num_classes": 2},
    {"type": "mlp", "num_features": float("nan"), "hidden_sizes": [4], "num_classes": 2},
    [],
    "mlp",
    None,
])
def test_model_from_spec_rejects_malformed(spec):
    with pytest.raises(ValueError):
        model_from_spec(spec)  # type: ignore[arg-type]


@pytest.mark.parametrize("field", ["num_features", "num_classes"])
def test_model_from_spec_infinite_number(field):
    spec = {"type": "mlp", "num_features": 4, "hidden_sizes": [4], "num_classes": 2, field: float("inf")}
    with pytest.raises(ValueError):
        model_from_spec(spec)


def test_model_from_spec_string_hidden_sizes():
    with pytest.raises(ValueError):
        model_from_spec({"type": "mlp", "num_features": 8, "hidden_sizes": "64", "num_classes": 3})


# --------------------------------------------------------------------------------------------------
# FlatParams
# --------------------------------------------------------------------------------------------------
def test_flat_params_keep_values_and_share_memory():
    model = build_mlp(64, [32], 10, seed=3)
    before = [p.detach().clone() for p in model.parameters()]
    flat = FlatParams(model)
    assert flat.numel == num_parameters(model) == flat.params.numel() == flat.grads.numel()
    assert flat.params.dtype == flat.grads.dtype == torch.float32
    assert torch.equal(flat.params, torch.cat([b.reshape(-1) for b in before]))
    # Parameters are views of flat.params: writing the flat vector changes them.
    flat.params[0] = 123.0
    assert next(model.parameters()).reshape(-1)[0].item() == 123.0
    base = flat.params.data_ptr()
    offset = 0
    for p in model.parameters():
        assert p.data_ptr() == base + offset * 4
        offset += p.numel()


def test_flat_grads_after_backward_match_per_parameter_grads():
    model = build_mlp(64, [32, 16], 10, seed=4)
    reference = copy.deepcopy(model)
    flat = FlatParams(model)
    x, y = batch()

    nn.functional.cross_entropy(model(x), y).backward()
    nn.functional.cross_entropy(reference(x), y).backward()

    params = list(model.parameters())
    # The flat vector is the concatenation of every parameter's .grad ...
    assert torch.equal(flat.grads, torch.cat([p.grad.reshape(-1) for p in params]))
    # ... which backward wrote in place: each .grad still views flat.grads.
    offset = 0
    for p in params:
        assert p.grad.data_ptr() == flat.grads.data_ptr() + offset * 4
        offset += p.numel()
    # And the values are the true gradients (computed on an untouched copy of the model).
    expected = torch.cat([p.grad.reshape(-1) for p in reference.parameters()])
    torch.testing.assert_close(flat.grads, expected)
    assert flat.grads.abs().sum() > 0


def test_flat_grads_zeroed_between_steps():
    model = build_mlp(64, [16], 10, seed=0)
    flat = FlatParams(model)
    x, y = batch(seed=1)
    nn.functional.cross_entropy(model(x), y).backward()
    once = flat.grads.clone()
    flat.grads.zero_()
    nn.functional.cross_entropy(model(x), y).backward()
    torch.testing.assert_close(flat.grads, once)  # not accumulated on top of the old gradient


def test_load_changes_model_outputs():
    model = build_mlp(64, [16], 10, seed=0)
    flat = FlatParams(model)
    x, _ = batch()
    before = model(x).detach().clone()
    other = FlatParams(build_mlp(64, [16], 10, seed=99))
    flat.load(other.params)
    after = model(x).detach()
    assert not torch.allclose(before, after)
    torch.testing.assert_close(after, other.model(x).detach())
    assert torch.equal(flat.params, other.params)
    flat.load(torch.zeros(flat.numel))
    assert torch.count_nonzero(model(x)) == 0


def test_load_wrong_size():
    flat = FlatParams(build_mlp(4, [3], 2, seed=0))
    with pytest.raises(ValueError, match=f"expected {flat.numel} parameters, got {flat.numel + 1}"):
        flat.load(torch.zeros(flat.numel + 1))


def test_optimizer_step_updates_flat_params():
    model = build_mlp(64, [16], 10, seed=0)
    flat = FlatParams(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    x, y = batch()
    nn.functional.cross_entropy(model(x), y).backward()
    before = flat.params.clone()
    grads = flat.grads.clone()
    opt.step()
    torch.testing.assert_close(flat.params, before - 0.5 * grads)
    assert math.isfinite(flat.params.sum().item())


def fixed_logits_model(weight: list[list[float]]) -> nn.Linear:
    """A bias-free linear map with the given (classes, features) weight: logits = x @ weight.T."""
    layer = nn.Linear(len(weight[0]), len(weight), bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.tensor(weight))
    return layer


def test_evaluate_accuracy_and_cross_entropy_of_known_logits():
    # Identity weights: the logits are the features. Sample 0 has logits (ln 3, 0) -> p(class 0) = 3/4,
    # sample 1 logits (0, 0) -> p = 1/2 for either, sample 2 logits (0, ln 3) -> p(class 1) = 3/4.
    model = fixed_logits_model([[1.0, 0.0], [0.0, 1.0]])
    x = np.array([[math.log(3), 0.0], [0.0, 0.0], [0.0, math.log(3)]], dtype=np.float32)
    y = np.array([0, 1, 0], dtype=np.int64)  # right, tie (argmax picks class 0: wrong), wrong
    accuracy, loss = evaluate(model, x, y)
    assert accuracy == pytest.approx(1 / 3)
    # cross-entropy: -(ln 3/4 + ln 1/2 + ln 1/4) / 3
    assert loss == pytest.approx(-(math.log(0.75) + math.log(0.5) + math.log(0.25)) / 3, rel=1e-6)
    assert model.training  # left in training mode


def test_flat_params_share_storage_with_the_parameters():
    model = build_mlp(4, [3], 2, seed=0)
    before = [p.detach().clone() for p in model.parameters()]
    params = list(model.parameters())
    flat = FlatParams(model)
    assert [p is q for p, q in zip(params, model.parameters())] == [True] * len(params)  # same Parameter objects
    assert torch.equal(flat.params, torch.cat([b.reshape(-1) for b in before]))
    flat.load(torch.arange(flat.numel, dtype=torch.float32))
    assert model[0].weight[0].tolist() == [0.0, 1.0, 2.0, 3.0]  # the first 4 values, row-major
    x, y = torch.ones(1, 4), torch.tensor([0])  # class 1 has the larger logit: a non-zero gradient
    nn.functional.cross_entropy(model(x), y).backward()
    assert torch.equal(flat.grads, torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    assert flat.grads.abs().sum() > 0


# --------------------------------------------------------------------------------------------------
# MomentumSGD: torch.optim.SGD's updates without torch's Optimizer class
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("lr, momentum", [(0.05, 0.9), (0.1, 0.0), (0.01, 0.5)])
def test_momentum_sgd_matches_torch_sgd_bit_for_bit(lr, momentum):
    from wiiide.training.model import MomentumSGD

    ours, ref = build_mlp(64, [32, 16], 10, seed=3), build_mlp(64, [32, 16], 10, seed=3)
    flat_ours, flat_ref = FlatParams(ours), FlatParams(ref)
    sgd_ours = MomentumSGD(ours.parameters(), lr=lr, momentum=momentum)
    sgd_ref = torch.optim.SGD(ref.parameters(), lr=lr, momentum=momentum)
    gen = torch.Generator().manual_seed(0)
    for _ in range(25):
        grads = torch.randn(flat_ours.numel, generator=gen)
        flat_ours.grads.copy_(grads)
        flat_ref.grads.copy_(grads)
        sgd_ours.step()
        sgd_ref.step()
        assert torch.equal(flat_ours.params, flat_ref.params)
    assert not torch.equal(flat_ours.params, FlatParams(build_mlp(64, [32, 16], 10, seed=3)).params)  # it moved


def test_momentum_sgd_does_not_import_dynamo():
    """The point of MomentumSGD: the coordinator's optimizer does not pull in torch._dynamo (~1 s of CPU)."""
    import subprocess
    import sys
    from pathlib import Path

    code = ("import sys; from wiiide.training.model import build_mlp, FlatParams, MomentumSGD\n"
            "m = build_mlp(8, [4], 2, seed=0); f = FlatParams(m); o = MomentumSGD(m.parameters(), 0.1, 0.9)\n"
            "f.grads.fill_(1.0); o.step(); o.step()\n"
            "print('torch._dynamo' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[2]).stdout
    assert out.strip() == "False"
