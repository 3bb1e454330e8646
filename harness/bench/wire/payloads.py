"""The bytes bench-wire moves: real gradients of the project's MLPs, and float32 slices of them.

Runs in the source peer (node image: numpy, torch and `wiiide` only).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

DIGITS_HIDDEN = (512, 512)  # digits MLP 64-512-512-10: 1,204,264 bytes of float32 gradient
SYNTHETIC = {False: (1024, (4096, 4096)), True: (256, (1024, 1024))}  # small -> (features, hidden sizes)


def real_gradient(dataset: str, hidden_sizes: Sequence[int], features: int = 256) -> np.ndarray:
    """One gradient of the project's MLP after one backward pass on the first 32 training samples.

    Args:
        dataset: a `wiiide.config.RunConfig` dataset name (``digits``, ``synthetic``).
        hidden_sizes: the MLP's hidden layer widths.
        features: input features of the synthetic data set (ignored by ``digits``).

    Returns:
        float32 array of shape (n_params,), a copy (the model is discarded).

    Raises:
        ConfigError: (wiiide) a dataset or size `RunConfig` refuses.
    """
    import torch
    from torch import nn

    from wiiide.config import RunConfig
    from wiiide.training.data import load_dataset
    from wiiide.training.model import FlatParams, build_mlp

    torch.set_num_threads(1)
    cfg = RunConfig(dataset=dataset, hidden_sizes=tuple(hidden_sizes), synthetic_features=features)
    data = load_dataset(cfg)
    model = build_mlp(data.num_features, hidden_sizes, data.num_classes, 0)
    flat = FlatParams(model)
    loss = nn.functional.cross_entropy(model(torch.from_numpy(data.x_train[:32])), torch.from_numpy(data.y_train[:32]))
    loss.backward()
    return flat.grads.numpy().copy()


def gradients(small: bool) -> dict[str, np.ndarray]:
    """The two gradients every section uses, by name.

    Returns:
        ``digits-mlp`` (64-512-512-10, 1.2 MB) and ``synthetic-mlp`` (1024-4096-4096-10, 84 MB; with
        `small`, 256-1024-1024-10, 5.3 MB): flat float32 arrays.

    Raises:
        ConfigError: as `real_gradient`.
    """
    features, hidden = SYNTHETIC[bool(small)]
    return {"digits-mlp": real_gradient("digits", DIGITS_HIDDEN),
            "synthetic-mlp": real_gradient("synthetic", hidden, features)}


def payload_of(size_bytes: int, source: np.ndarray) -> np.ndarray:
    """`size_bytes` of float32 taken from the start of `source` (tiled when `source` is shorter).

    Args:
        size_bytes: payload size in bytes, a positive multiple of 4.
        source: flat float32 array (a gradient).

    Returns:
        C-contiguous float32 array of shape (size_bytes // 4,), so exactly `size_bytes` bytes.

    Raises:
        ValueError: `size_bytes` not a positive multiple of 4.
    """
    if size_bytes < 4 or size_bytes % 4:
        raise ValueError(f"payload size {size_bytes} bytes: must be a positive multiple of 4 (float32)")
    n = size_bytes // 4
    if n <= source.size:
        return np.ascontiguousarray(source[:n], dtype=np.float32)
    return np.resize(source, n).astype(np.float32)
