"""The MLP: Linear+ReLU layers on flat float32 features (today's model, moved from `wiiide.training.model`).

Sizes: 64-64-10 on digits is 4,810 parameters (19 KB of gradient); 1024-4096-4096-10 on 1,024
synthetic features is about 21 M parameters (84 MB).
"""

from __future__ import annotations

from typing import Sequence

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
