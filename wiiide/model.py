"""The model: an MLP with configurable hidden sizes, and flat views of its parameters and gradients.

Parameters live in one contiguous float32 vector, so a gradient or a parameter update is one tensor on
the wire. Sizes: 64-64-10 on digits is 4,810 parameters (19 KB of gradient); 1024-4096-4096-10 on
1,024 synthetic features is about 21 M parameters (84 MB).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn


def build_mlp(num_features: int, hidden_sizes: Sequence[int], num_classes: int, seed: int) -> nn.Sequential:
    """Linear+ReLU layers of the given widths, then a Linear to `num_classes` logits (float32)."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    width = num_features
    for h in hidden_sizes:
        layers += [nn.Linear(width, h), nn.ReLU()]
        width = h
    layers.append(nn.Linear(width, num_classes))
    return nn.Sequential(*layers)


def model_spec(num_features: int, hidden_sizes: Sequence[int], num_classes: int) -> dict[str, Any]:
    """The JSON description a worker needs to build the same model."""
    return {"type": "mlp", "num_features": num_features, "hidden_sizes": list(hidden_sizes), "num_classes": num_classes}


def model_from_spec(spec: dict[str, Any]) -> nn.Sequential:
    """Build the model a coordinator described. Raises ValueError on a malformed description."""
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
    return sum(p.numel() for p in model.parameters())


class FlatParams:
    """Keeps a model's parameters and gradients as views into two flat float32 vectors."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        params = list(model.parameters())
        self.numel = sum(p.numel() for p in params)
        self.params = torch.zeros(self.numel, dtype=torch.float32)
        self.grads = torch.zeros(self.numel, dtype=torch.float32)
        offset = 0
        for p in params:
            n = p.numel()
            self.params[offset:offset + n].copy_(p.data.reshape(-1))
            p.data = self.params[offset:offset + n].view_as(p)
            p.grad = self.grads[offset:offset + n].view_as(p)
            offset += n

    def load(self, flat: torch.Tensor) -> None:
        """Copy a flat float32 vector of `numel` values into the parameters."""
        if flat.numel() != self.numel:
            raise ValueError(f"expected {self.numel} parameters, got {flat.numel()}")
        self.params.copy_(flat.reshape(-1))
