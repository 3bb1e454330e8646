"""The model: an MLP with configurable hidden sizes, flat views of its parameters and gradients, and
its evaluation on the held-out split (`evaluate`, used by every engine).

Parameters live in one contiguous float32 vector, so a gradient or a parameter update is one tensor on
the wire. Sizes: 64-64-10 on digits is 4,810 parameters (19 KB of gradient); 1024-4096-4096-10 on
1,024 synthetic features is about 21 M parameters (84 MB).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch
from torch import nn


def build_mlp(num_features: int, hidden_sizes: Sequence[int], num_classes: int, seed: int) -> nn.Sequential:
    """Linear+ReLU layers of the given widths, then a Linear to `num_classes` logits.

    Input (batch, `num_features`) float32, output (batch, `num_classes`) float32 logits. Weights are
    PyTorch's default initialisation after ``torch.manual_seed(seed)``, so equal arguments build equal
    models on every node.
    """
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    width = num_features
    for h in hidden_sizes:
        layers += [nn.Linear(width, h), nn.ReLU()]
        width = h
    layers.append(nn.Linear(width, num_classes))
    return nn.Sequential(*layers)


def model_spec(num_features: int, hidden_sizes: Sequence[int], num_classes: int) -> dict[str, Any]:
    """The JSON description a worker needs to build the same model (`model_from_spec` reads it)."""
    return {"type": "mlp", "num_features": num_features, "hidden_sizes": list(hidden_sizes), "num_classes": num_classes}


def model_from_spec(spec: dict[str, Any]) -> nn.Sequential:
    """Build the model a coordinator described (`model_spec`), with seed 0 (the coordinator sends its
    parameters right after, so the seed does not matter).

    Raises:
        ValueError: a malformed description (missing keys, non-integers) or sizes out of range
            (features 1..1,000,000, classes 1..100,000, 1..16 hidden layers of 1..65,536).
    """
    def whole(value: Any) -> int:
        # JSON integers only: no bools, floats (1e400 is inf), strings or lists of digits
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"expected an integer, got {type(value).__name__}")
        return value

    try:
        if spec.get("type") != "mlp":
            raise ValueError(f"unknown model type {spec.get('type')!r}")
        if not isinstance(spec["hidden_sizes"], list):
            raise TypeError("hidden_sizes must be a list")
        nf, hs, nc = whole(spec["num_features"]), [whole(h) for h in spec["hidden_sizes"]], whole(spec["num_classes"])
    except (KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"malformed model description: {exc}") from None
    if not (0 < nf <= 1_000_000 and 0 < nc <= 100_000 and 0 < len(hs) <= 16 and all(0 < h <= 65536 for h in hs)):
        raise ValueError("model description out of range")
    return build_mlp(nf, hs, nc, seed=0)


def num_parameters(model: nn.Module) -> int:
    """The number of scalar parameters (elements, not bytes) of `model`."""
    return sum(p.numel() for p in model.parameters())


class FlatParams:
    """Keeps a model's parameters and gradients as views into two flat float32 vectors.

    After construction `params` and `grads` are 1-D float32 tensors of `numel` elements, in
    ``model.parameters()`` order; every parameter (the same `nn.Parameter` objects, so optimizers
    built before or after keep working) and its ``.grad`` are views of them, so a gradient or an
    update is one tensor on the wire. Uses the public ``Tensor.set_`` under ``torch.no_grad()``
    rather than assigning ``.data``.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        params = list(model.parameters())
        self.numel = sum(p.numel() for p in params)
        self.params = torch.zeros(self.numel, dtype=torch.float32)
        self.grads = torch.zeros(self.numel, dtype=torch.float32)
        offset = 0
        with torch.no_grad():
            for p in params:
                n = p.numel()
                view = self.params[offset:offset + n].view_as(p)
                view.copy_(p)
                p.set_(view)  # the parameter now shares the flat vector's storage
                p.grad = self.grads[offset:offset + n].view_as(p)
                offset += n

    def load(self, flat: torch.Tensor) -> None:
        """Copy a flat float32 vector of `numel` values into the parameters.

        Raises:
            ValueError: `flat` does not hold exactly `numel` elements.
        """
        if flat.numel() != self.numel:
            raise ValueError(f"expected {self.numel} parameters, got {flat.numel()}")
        self.params.copy_(flat.reshape(-1))


class MomentumSGD:
    """``torch.optim.SGD(params, lr=lr, momentum=momentum)`` (no dampening, weight decay or Nesterov),
    the same update step for step: `step` calls torch's public functional API ``torch.optim.sgd.sgd``,
    the function ``SGD.step`` calls, with the same arguments and momentum buffers.

    Why not ``torch.optim.SGD`` itself: the methods of torch's `Optimizer` class are wrapped by
    ``torch._disable_dynamo``, which imports ``torch._dynamo`` (with sympy and mpmath: about 800
    modules) at their first call: 1.0 s of CPU on this project's machine (torch 2.13), measured on
    the coordinator's path to its first step, where nine nodes share two cores.

    Args:
        params: the parameters (float32 tensors with ``.grad``, e.g. `FlatParams`' views).
        lr: the learning rate; momentum: the momentum factor (0: plain SGD).
    """

    def __init__(self, params: Any, lr: float, momentum: float = 0.0) -> None:
        self.params: list[torch.Tensor] = list(params)
        self.lr = float(lr)
        self.momentum = float(momentum)
        self.momentum_buffers: dict[int, torch.Tensor | None] = {}

    def step(self) -> None:
        """One update of every parameter that has a gradient (``p -= lr * b``, ``b = momentum * b + grad``,
        ``b = grad`` at the first step), in place and without autograd recording it."""
        from torch.optim.sgd import sgd

        indices = [i for i, p in enumerate(self.params) if p.grad is not None]
        params = [self.params[i] for i in indices]
        grads = [p.grad for p in params]
        buffers = [self.momentum_buffers.get(i) for i in indices] if self.momentum != 0 else []
        with torch.no_grad():
            sgd(params, grads, buffers, has_sparse_grad=any(g.is_sparse for g in grads), foreach=None, fused=None,
                weight_decay=0.0, momentum=self.momentum, lr=self.lr, dampening=0.0, nesterov=False,
                maximize=False)
        if self.momentum != 0:
            for i, buffer in zip(indices, buffers):
                self.momentum_buffers[i] = buffer


def evaluate(model: nn.Module, x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """(accuracy in 0..1, mean cross-entropy in nats) of `model` on a held-out split.

    Args:
        model: a classifier returning (n, classes) logits; left in training mode afterwards.
        x: float32 features, shape (n, features).
        y: int64 class labels, shape (n,).

    Raises:
        RuntimeError: from torch, when the shapes or dtypes do not fit the model.
    """
    model.eval()
    with torch.no_grad():
        logits = model(torch.from_numpy(x))
        labels = torch.from_numpy(y)
        loss = nn.functional.cross_entropy(logits, labels).item()
        accuracy = (logits.argmax(dim=1) == labels).float().mean().item()
    model.train()
    return accuracy, loss


def held_out_metric(model: nn.Module, data: Any) -> tuple[str, float, bool]:
    """The one figure time to target is judged on: (name, value, higher_is_better) of `model` on the
    held-out split of `data` (a `wiiide.data.Dataset`: ``x_test`` float32 (n, features), ``y_test``
    int64 (n,)).

    Classification (every model today): ``("accuracy", accuracy in 0..1, True)``, compared with
    ``target_accuracy``. A language model returns ``("validation_loss", nats per token, False)``,
    compared with ``target_loss`` (`wiiide.evaluation.target_of`).

    Raises:
        RuntimeError: from torch, when the shapes or dtypes do not fit the model.
    """
    accuracy, _loss = evaluate(model, data.x_test, data.y_test)
    return "accuracy", accuracy, True
