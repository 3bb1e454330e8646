"""A small ResNet-style CNN on square single-channel images (the 8x8 digits): many small tensors.

Layers (C = `channels`): conv3x3 1->C, ReLU; a residual block (two conv3x3 C->C with a ReLU between,
added to its input, no batch norm: it would add running statistics, buffers outside the gradient);
conv3x3 C->2C, ReLU, 2x2 max-pool; Linear 2C*(s/2)^2 -> 64, ReLU; Linear 64 -> classes. 12 parameter
tensors; C=16 on 8x8 is 42,922 parameters. Input: flat float32 (batch, s*s) features, reshaped to
(batch, 1, s, s) inside `forward`, so the batches on the wire are the MLP's.
"""

from __future__ import annotations

import math

import torch
from torch import nn


class ResidualCNN(nn.Module):
    """See the module docstring. Input float32 (batch, side*side), output float32 (batch, classes) logits."""

    def __init__(self, side: int, channels: int, num_classes: int) -> None:
        super().__init__()
        self.side = side
        c = channels
        self.stem = nn.Conv2d(1, c, 3, padding=1)
        self.res1 = nn.Conv2d(c, c, 3, padding=1)
        self.res2 = nn.Conv2d(c, c, 3, padding=1)
        self.widen = nn.Conv2d(c, 2 * c, 3, padding=1)
        pooled = side // 2
        self.fc = nn.Linear(2 * c * pooled * pooled, 64)
        self.head = nn.Linear(64, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits (batch, classes) of flat images (batch, side*side)."""
        h = torch.relu(self.stem(x.reshape(-1, 1, self.side, self.side)))
        h = torch.relu(h + self.res2(torch.relu(self.res1(h))))
        h = nn.functional.max_pool2d(torch.relu(self.widen(h)), 2)
        return self.head(torch.relu(self.fc(h.flatten(1))))


def image_side(num_features: int) -> int:
    """The side s of a square s x s image with `num_features` pixels.

    Raises:
        ValueError: `num_features` is not a perfect square of at least 4 (2x2).
    """
    side = math.isqrt(num_features)
    if side * side != num_features or side < 2:
        raise ValueError(f"model cnn needs square images: {num_features} features are not s*s with s >= 2 "
                         "(digits: 64 = 8x8; synthetic: set synthetic_features to a square)")
    return side


def build_cnn(num_features: int, channels: int, num_classes: int, seed: int) -> ResidualCNN:
    """`ResidualCNN` after ``torch.manual_seed(seed)``. Raises ValueError as `image_side` does."""
    side = image_side(num_features)
    torch.manual_seed(seed)
    return ResidualCNN(side, channels, num_classes)
