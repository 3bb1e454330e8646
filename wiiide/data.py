"""Data sets: scikit-learn's handwritten digits (real, ships with the package) and a synthetic set.

Both return float32 features standardised with the training split's statistics and int64 labels,
split into train/test with a fixed seed, so every node and every engine sees the same data.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from wiiide.config import RunConfig
from wiiide.errors import ConfigError


@dataclass(frozen=True)
class Dataset:
    """x_*: float32 (n, features); y_*: int64 (n,) class ids in 0..num_classes-1."""

    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_features: int
    num_classes: int


def load_dataset(cfg: RunConfig) -> Dataset:
    """The configured data set, split with ``cfg.seed`` and ``cfg.test_fraction``.

    digits: ``sklearn.datasets.load_digits`` (1,797 8x8 images, 10 classes; UCI optdigits test set).
    synthetic: ``sklearn.datasets.make_classification`` with the configured samples/features/classes.
    """
    try:
        return _load(cfg)
    except ValueError as exc:  # sklearn's refusal of a size combination RunConfig cannot foresee
        raise ConfigError(f"data set {cfg.dataset!r} cannot be made from this config "
                          f"(synthetic_samples/_features/_classes, test_fraction): {exc}") from None


def _load(cfg: RunConfig) -> Dataset:
    from sklearn.model_selection import train_test_split

    if cfg.dataset == "digits":
        from sklearn.datasets import load_digits

        x, y = load_digits(return_X_y=True)
    else:
        from sklearn.datasets import make_classification

        informative = max(2, min(cfg.synthetic_features // 2, 64))
        x, y = make_classification(
            n_samples=cfg.synthetic_samples, n_features=cfg.synthetic_features,
            n_informative=informative, n_redundant=0, n_classes=cfg.synthetic_classes,
            n_clusters_per_class=1, class_sep=2.0, random_state=cfg.seed,
        )
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=cfg.test_fraction, random_state=cfg.seed, stratify=y
    )
    mean = x_train.mean(axis=0)
    std = x_train.std(axis=0)
    std[std == 0] = 1.0
    def prep(a: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray((a - mean) / std, dtype=np.float32)
    num_classes = int(np.max(y)) + 1
    return Dataset(
        name=cfg.dataset,
        x_train=prep(x_train), y_train=y_train.astype(np.int64),
        x_test=prep(x_test), y_test=y_test.astype(np.int64),
        num_features=int(x.shape[1]), num_classes=num_classes,
    )


class BatchSampler:
    """Endless shuffled mini-batches of the training split (reshuffled every epoch, seeded)."""

    def __init__(self, num_samples: int, batch_size: int, seed: int) -> None:
        self.num_samples = num_samples
        self.batch_size = min(batch_size, num_samples)
        self.rng = np.random.default_rng(seed)
        self.epoch = 0
        self._order = self.rng.permutation(num_samples)
        self._pos = 0

    @property
    def epochs_done(self) -> float:
        """Passes over the training split so far, fractional."""
        return self.epoch + self._pos / self.num_samples

    def next_indices(self) -> np.ndarray:
        """int64 (batch_size,) indices into the training split."""
        if self._pos + self.batch_size > self.num_samples:
            self._order = self.rng.permutation(self.num_samples)
            self._pos = 0
            self.epoch += 1
        idx = self._order[self._pos:self._pos + self.batch_size]
        self._pos += self.batch_size
        return idx
