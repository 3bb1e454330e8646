"""Flat views of a model's parameters and gradients, the optimizer, and the evaluation on the held-out
split (`evaluate`, used by every engine). The models themselves live in `wiiide.training.models`; `build_mlp`,
`model_spec` and `model_from_spec` stay importable from here.

Parameters live in one contiguous float32 vector, so a gradient or a parameter update is one tensor on
the wire. Sizes: 64-64-10 on digits is 4,810 parameters (19 KB of gradient); 1024-4096-4096-10 on
1,024 synthetic features is about 21 M parameters (84 MB).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Sequence

import numpy as np
import torch
from torch import nn

from wiiide.training import models
from wiiide.training.models.mlp import build_mlp  # noqa: F401 (re-exported: importable from here as before)

# The language model's validation: at most this many windows (evenly spaced over the split), this many
# at a time, so that an evaluation of a 25 M-parameter model takes seconds, not minutes, on one core.
EVAL_MAX_WINDOWS = 64
EVAL_BATCH_WINDOWS = 16


def model_spec(num_features: int, hidden_sizes: Sequence[int], num_classes: int) -> dict[str, Any]:
    """The JSON description of an MLP (`model_from_spec` reads it); `wiiide.training.models.model_spec` describes any model."""
    return {"type": "mlp", "num_features": num_features, "hidden_sizes": list(hidden_sizes), "num_classes": num_classes}


def model_from_spec(spec: dict[str, Any]) -> nn.Module:
    """Build the model a coordinator described (`wiiide.training.models.model_spec`: mlp, cnn, transformer or
    embedding), with seed 0 (the coordinator sends its parameters right after, so the seed does not matter).

    Raises:
        ValueError: a malformed description (missing keys, non-integers) or sizes out of range
            (mlp: features 1..1,000,000, classes 1..100,000, 1..16 hidden layers of 1..65,536; the
            others: `wiiide.training.models`).
    """
    return models.model_from_spec(spec)


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


class ClassificationEval(NamedTuple):
    """Held-out figures of a classifier: accuracy in 0..1 and mean cross-entropy in nats (unpacks as
    ``accuracy, loss``, as ``evaluate`` returned them before it returned a type per task)."""

    accuracy: float
    loss: float

    def to_metrics(self) -> dict[str, float]:
        """The node's metrics fields: ``test_accuracy``, ``test_loss``."""
        return {"test_accuracy": self.accuracy, "test_loss": self.loss}

    def log_text(self) -> str:
        """``accuracy 0.9611, loss 0.1270``: the words of the node's final log line (`harness.run.status` reads it)."""
        return f"accuracy {self.accuracy:.4f}, loss {self.loss:.4f}"


class LanguageModelEval(NamedTuple):
    """Held-out figures of a language model: mean next-byte cross-entropy in nats, its perplexity
    (``exp(loss)``), and the bytes (tokens) it was measured on."""

    loss: float
    perplexity: float
    tokens: int

    def to_metrics(self) -> dict[str, float | int]:
        """The node's metrics fields: ``validation_loss``, ``perplexity``, ``validation_tokens``, and
        ``test_loss`` (the same loss, under the name every model's reports share)."""
        return {"validation_loss": self.loss, "perplexity": self.perplexity, "validation_tokens": self.tokens,
                "test_loss": self.loss}

    def log_text(self) -> str:
        """``validation loss 2.1092, perplexity 8.2420``: the words of the node's final log line."""
        return f"validation loss {self.loss:.4f}, perplexity {self.perplexity:.4f}"


def evaluate(model: nn.Module, x: np.ndarray, y: np.ndarray, task: str = "classification"
             ) -> ClassificationEval | LanguageModelEval:
    """The held-out figures of `model` (left in training mode afterwards).

    Args:
        model: a classifier returning (n, classes) logits, or a language model returning (n, T, 256).
        x: classification: float32 features (n, features) or int64 ids (n, fields); language model:
            int64 (n, T) byte windows (at most `EVAL_MAX_WINDOWS` evenly spaced ones are used).
        y: int64 class labels (n,), or int64 next bytes (n, T).
        task: ``classification`` or ``language_model`` (`wiiide.training.models.task_of`).

    Returns:
        `ClassificationEval` or `LanguageModelEval`.

    Raises:
        RuntimeError: from torch, when the shapes or dtypes do not fit the model.
        ValueError: an unknown task.
    """
    if task not in ("classification", "language_model"):
        raise ValueError(f"unknown task {task!r}; known: classification, language_model")
    model.eval()
    try:
        with torch.no_grad():
            if task == "classification":
                logits = model(torch.from_numpy(x))
                labels = torch.from_numpy(y)
                loss = nn.functional.cross_entropy(logits, labels).item()
                accuracy = (logits.argmax(dim=1) == labels).float().mean().item()
                return ClassificationEval(accuracy, loss)
            pick = np.unique(np.linspace(0, len(x) - 1, num=min(len(x), EVAL_MAX_WINDOWS)).round().astype(np.int64))
            total, tokens = 0.0, 0
            for i in range(0, len(pick), EVAL_BATCH_WINDOWS):
                rows = pick[i:i + EVAL_BATCH_WINDOWS]
                target = torch.from_numpy(y[rows])
                logits = model(torch.from_numpy(x[rows]))
                total += nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1),
                                                     reduction="sum").item()
                tokens += target.numel()
            loss = total / tokens
            return LanguageModelEval(loss, math.exp(min(loss, 700.0)), tokens)
    finally:
        model.train()


def held_out_metric(model: nn.Module, data: Any) -> tuple[str, float, bool]:
    """The one figure time to target is judged on: (name, value, higher_is_better) of `model` on the
    held-out split of `data` (a `wiiide.training.data.Dataset`: ``x_test``, ``y_test`` and its ``task``).

    Classification: ``("accuracy", accuracy in 0..1, True)``, compared with ``target_accuracy``. A
    language model: ``("validation_loss", nats per byte, False)``, compared with ``target_loss``
    (`wiiide.training.evaluation.target_of`).

    Raises:
        RuntimeError: from torch, when the shapes or dtypes do not fit the model.
    """
    task = getattr(data, "task", "classification")
    result = evaluate(model, data.x_test, data.y_test, task)
    if isinstance(result, LanguageModelEval):
        return "validation_loss", result.loss, False
    return "accuracy", result.accuracy, True
