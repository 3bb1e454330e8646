"""Data sets: scikit-learn's handwritten digits (real, ships with the package) and a synthetic set.

Both return float32 features standardised with the training split's statistics and int64 labels,
split into train/test with a fixed seed, so every node and every engine sees the same data.

The digits are read from the CSV file scikit-learn ships (``sklearn/datasets/data/digits.csv.gz``,
what ``load_digits`` reads) and split by `stratified_split`, a copy of scikit-learn's stratified
``train_test_split``: the same arrays in the same order, without importing scikit-learn (about
1.1 s of CPU per coordinator start). The synthetic set still comes from scikit-learn.
"""

from __future__ import annotations

import gzip
import importlib.util
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from wiiide.config import RunConfig
from wiiide.errors import ConfigError


@dataclass(frozen=True)
class Dataset:
    """x_*: float32 (n, features), or int64 (n, fields) ids (embedding), or int64 (n, T) bytes (language
    model); y_*: int64 (n,) class ids in 0..num_classes-1, or int64 (n, T) next bytes.

    task: ``classification`` or ``language_model``; tokens_per_sample: T for the language model, else 1;
    info: what a report records about the data (the corpus' files and bytes, the Zipf parameters).
    """

    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_features: int
    num_classes: int
    task: str = "classification"
    tokens_per_sample: int = 1
    info: dict[str, Any] = field(default_factory=dict)


def load_dataset(cfg: RunConfig) -> Dataset:
    """The configured data set, split with ``cfg.seed`` and ``cfg.test_fraction``.

    digits: scikit-learn's digits file (`load_digits_arrays`: 1,797 8x8 images, 10 classes; UCI
    optdigits test set), split by `stratified_split` (scikit-learn's split, without scikit-learn).
    synthetic: ``sklearn.datasets.make_classification`` with the configured samples/features/classes.
    model transformer: the pinned Python standard-library corpus (`wiiide.training.corpus`), split by file, in
    windows of ``transformer_context`` bytes. model embedding: `wiiide.training.models.embedding.make_zipf_data`.

    Raises:
        ConfigError: a size combination the data set cannot be made from, or a missing/changed corpus.
    """
    model = getattr(cfg, "model", "mlp")
    if model == "transformer":
        return _load_corpus(cfg)
    if model == "embedding":
        return _load_zipf(cfg)
    try:
        return _load(cfg)
    except ValueError as exc:  # sklearn's refusal of a size combination RunConfig cannot foresee
        raise ConfigError(f"data set {cfg.dataset!r} cannot be made from this config "
                          f"(synthetic_samples/_features/_classes, test_fraction): {exc}") from None


def digits_csv_path() -> Path:
    """The digits file inside the installed scikit-learn, found without importing it.

    Raises:
        ConfigError: scikit-learn is not installed (or ships no digits file).
    """
    spec = importlib.util.find_spec("sklearn")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location) / "datasets" / "data" / "digits.csv.gz"
        if path.is_file():
            return path
    raise ConfigError("data set 'digits' needs scikit-learn's sklearn/datasets/data/digits.csv.gz; "
                      "install scikit-learn (a dependency in pyproject.toml) or use dataset=synthetic")


def load_digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """What ``sklearn.datasets.load_digits(return_X_y=True)`` returns, read as it reads it.

    Returns:
        x: float64 (1797, 64) pixel values 0..16; y: int (1797,) digits 0..9.

    Raises:
        ConfigError: no scikit-learn; OSError / ValueError: an unreadable file.
    """
    with gzip.open(digits_csv_path(), mode="rt", encoding="utf-8") as f:
        data = np.loadtxt(f, delimiter=",")
    return data[:, :-1], data[:, -1].astype(int, copy=False)


def _approximate_mode(class_counts: np.ndarray, n_draws: int, rng: np.random.RandomState) -> np.ndarray:
    """scikit-learn's ``sklearn.utils.extmath._approximate_mode`` (1.3-1.9), line for line: the most
    likely per-class counts of `n_draws` draws without replacement, ties broken with `rng`.
    int (n_classes,) summing to `n_draws`."""
    continuous = class_counts / class_counts.sum() * n_draws
    floored = np.floor(continuous)
    need_to_add = int(n_draws - floored.sum())
    if need_to_add > 0:
        remainder = continuous - floored
        values = np.sort(np.unique(remainder))[::-1]
        for value in values:
            (inds,) = np.where(remainder == value)
            add_now = min(len(inds), need_to_add)
            inds = rng.choice(inds, size=add_now, replace=False)
            floored[inds] += 1
            need_to_add -= add_now
            if need_to_add == 0:
                break
    return floored.astype(int)


def stratified_split(x: np.ndarray, y: np.ndarray, test_fraction: float, seed: int
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``sklearn.model_selection.train_test_split(x, y, test_size=test_fraction, random_state=seed,
    stratify=y)`` without scikit-learn: the first split of ``StratifiedShuffleSplit`` (scikit-learn
    1.3-1.9, ``_iter_indices``), the same indices drawn from the same ``RandomState(seed)`` in the
    same order (tests/unit/test_data.py checks it against scikit-learn).

    Args:
        x: (n, ...) samples; y: (n,) integer labels; test_fraction: 0 < f < 1; seed: the RandomState seed.

    Returns:
        x_train, x_test, y_train, y_test (rows of `x` and `y`).

    Raises:
        ValueError: where scikit-learn refuses (a class with one member, fewer train or test samples
            than classes); the split is then left to scikit-learn for its exact message.
    """
    n_samples = len(y)
    n_test = math.ceil(test_fraction * n_samples)
    n_train = n_samples - n_test
    classes, y_indices, class_counts = np.unique(y, return_inverse=True, return_counts=True)
    n_classes = classes.shape[0]
    if not 0.0 < test_fraction < 1.0 or n_train <= 0 or np.min(class_counts) < 2 or n_train < n_classes \
            or n_test < n_classes:
        # scikit-learn refuses these; it raises its own ValueError, with its words
        from sklearn.model_selection import train_test_split

        return tuple(train_test_split(x, y, test_size=test_fraction, random_state=seed, stratify=y))
    class_indices = np.split(np.argsort(y_indices.reshape(-1), kind="stable"), np.cumsum(class_counts)[:-1])
    rng = np.random.RandomState(seed)
    n_i = _approximate_mode(class_counts, n_train, rng)
    t_i = _approximate_mode(class_counts - n_i, n_test, rng)
    train: list[int] = []
    test: list[int] = []
    for i in range(n_classes):
        permutation = rng.permutation(class_counts[i])
        perm_indices_class_i = class_indices[i].take(permutation, mode="clip")
        train.extend(perm_indices_class_i[: n_i[i]])
        test.extend(perm_indices_class_i[n_i[i]: n_i[i] + t_i[i]])
    train_idx, test_idx = rng.permutation(train), rng.permutation(test)
    return x[train_idx], x[test_idx], y[train_idx], y[test_idx]


def _load(cfg: RunConfig) -> Dataset:
    if cfg.dataset == "digits":
        x, y = load_digits_arrays()
        x_train, x_test, y_train, y_test = stratified_split(x, y, cfg.test_fraction, cfg.seed)
    else:
        from sklearn.datasets import make_classification
        from sklearn.model_selection import train_test_split

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


def _load_corpus(cfg: RunConfig) -> Dataset:
    from wiiide.training.corpus import VOCAB_SIZE, load_corpus, unigram_loss_nats, windows

    corpus = load_corpus()
    x_train, y_train = windows(corpus.train, cfg.transformer_context)
    x_test, y_test = windows(corpus.validation, cfg.transformer_context)
    info = corpus.info()
    info["unigram_loss_nats"] = unigram_loss_nats(corpus.train, corpus.validation)
    return Dataset(name=corpus.name, x_train=x_train, y_train=y_train, x_test=x_test, y_test=y_test,
                   num_features=cfg.transformer_context, num_classes=VOCAB_SIZE, task="language_model",
                   tokens_per_sample=cfg.transformer_context, info=info)


def _load_zipf(cfg: RunConfig) -> Dataset:
    from wiiide.training.models.embedding import NUM_CLASSES, make_zipf_data

    x, y = make_zipf_data(cfg.embedding_samples, cfg.embedding_rows, cfg.embedding_fields,
                          cfg.embedding_zipf_exponent, cfg.seed)
    n_test = max(1, int(round(cfg.test_fraction * len(y))))
    return Dataset(name="zipf", x_train=x[n_test:], y_train=y[n_test:], x_test=x[:n_test], y_test=y[:n_test],
                   num_features=cfg.embedding_fields, num_classes=NUM_CLASSES,
                   info={"rows": cfg.embedding_rows, "fields": cfg.embedding_fields,
                         "zipf_exponent": cfg.embedding_zipf_exponent, "samples": len(y),
                         "label_share_positive": float(y.mean())})


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

    def next_indices(self, count: int | None = None) -> np.ndarray:
        """int64 (count,) indices into the training split; `count` defaults to batch_size and is capped at
        the split's size (adaptive and local-SGD batches ask for other counts)."""
        count = self.batch_size if count is None else max(1, min(int(count), self.num_samples))
        if self._pos + count > self.num_samples:
            self._order = self.rng.permutation(self.num_samples)
            self._pos = 0
            self.epoch += 1
        idx = self._order[self._pos:self._pos + count]
        self._pos += count
        return idx
