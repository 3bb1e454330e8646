"""A recommendation-style model: one large embedding table looked up by Zipf-distributed ids, then a
small MLP; and its synthetic data, whose labels have structure the model can learn.

Model: each sample is `fields` ids into one table of `rows` x `dim` float32; the looked-up rows are
concatenated (fields x dim) and go through Linear(fields*dim -> 64), ReLU, Linear(64 -> 2). The table
is the first parameter, so in a flat parameter vector it comes first (`wiiide.server.sparse` relies on it).
A step touches at most batch x fields rows: with 1 M rows, 32 x 8 ids touch at most 256 rows, 0.03 %.

Data (`make_zipf_data`): ids are drawn with P(id = k) proportional to 1 / (k + 1)^s (Zipf's law over
the finite table, exponent s = `zipf_exponent`, sampled by inverse CDF); every row k has a hidden
weight w_k ~ N(0, 1) (seeded), and a sample's label is 1 when sum over its fields of w_id > 0, else 0.
Frequent rows are learned quickly; rows seen once or never cannot be, which bounds the accuracy.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

HIDDEN = 64
NUM_CLASSES = 2


class EmbeddingMLP(nn.Module):
    """Input int64 (batch, fields) ids in 0..rows-1, output float32 (batch, 2) logits.

    ``sparse=True`` makes the table's gradient a sparse COO tensor (``nn.Embedding(sparse=True)``), which
    gloo all-reduces as a sparse tensor under DDP; False gives a dense (rows, dim) gradient.
    """

    def __init__(self, rows: int, dim: int, fields: int, sparse: bool = False) -> None:
        super().__init__()
        self.table = nn.Embedding(rows, dim, sparse=sparse)
        self.fc = nn.Linear(fields * dim, HIDDEN)
        self.head = nn.Linear(HIDDEN, NUM_CLASSES)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits (batch, 2) of int64 ids (batch, fields)."""
        return self.forward_looked_up(self.table(ids))

    def forward_looked_up(self, looked_up: torch.Tensor) -> torch.Tensor:
        """Logits (batch, 2) of the rows already looked up, float32 (batch, fields, dim): the model after
        its table (`wiiide.server.sparse` looks the rows up itself, so that the table's gradient is one row per
        distinct id and never a dense (rows, dim) tensor)."""
        return self.head(torch.relu(self.fc(looked_up.flatten(1))))


def build_embedding(rows: int, dim: int, fields: int, seed: int, sparse: bool = False) -> EmbeddingMLP:
    """`EmbeddingMLP` after ``torch.manual_seed(seed)``; the table starts at N(0, 0.1^2) (torch's N(0, 1)
    would swamp the small MLP)."""
    torch.manual_seed(seed)
    model = EmbeddingMLP(rows, dim, fields, sparse)
    with torch.no_grad():
        model.table.weight.mul_(0.1)
    return model


def zipf_probabilities(rows: int, exponent: float) -> np.ndarray:
    """float64 (rows,): P(id = k) proportional to 1 / (k + 1)^exponent, summing to 1 (Zipf's law)."""
    weights = 1.0 / np.power(np.arange(1, rows + 1, dtype=np.float64), exponent)
    return weights / weights.sum()


def expected_distinct_rows(probabilities: np.ndarray, draws: int) -> float:
    """Expected number of distinct ids among `draws` independent draws: sum_k 1 - (1 - p_k)^draws
    (linearity of expectation over the indicator "row k drawn at least once")."""
    return float(np.sum(-np.expm1(draws * np.log1p(-np.minimum(probabilities, 1 - 1e-16)))))


def make_zipf_data(samples: int, rows: int, fields: int, exponent: float, seed: int
                   ) -> tuple[np.ndarray, np.ndarray]:
    """`samples` samples of `fields` Zipf ids and their labels (see the module docstring).

    Returns:
        x: int64 (samples, fields) ids in 0..rows-1; y: int64 (samples,) labels 0/1.
    """
    rng = np.random.default_rng(seed)
    cdf = np.cumsum(zipf_probabilities(rows, exponent))
    ids = np.minimum(np.searchsorted(cdf, rng.random((samples, fields))), rows - 1).astype(np.int64)
    hidden = rng.standard_normal(rows)
    labels = (hidden[ids].sum(axis=1) > 0).astype(np.int64)
    return ids, labels
