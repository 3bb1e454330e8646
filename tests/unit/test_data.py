"""wiiide.training.data: the digits and synthetic splits, and the batch sampler."""

from __future__ import annotations

import numpy as np
import pytest

from wiiide.config import RunConfig
from wiiide.training.data import BatchSampler, load_dataset, load_digits_arrays, stratified_split
from wiiide.errors import ConfigError


@pytest.fixture(scope="module")
def digits():
    return load_dataset(RunConfig(dataset="digits", seed=0, test_fraction=0.2))


def test_digits_split_sizes(digits):
    assert len(digits.y_train) + len(digits.y_test) == 1797
    assert len(digits.y_test) == 360  # ceil(0.2 * 1797), as scikit-learn rounds the test share up
    assert digits.x_train.shape == (1437, 64) and digits.x_test.shape == (360, 64)
    assert digits.num_features == 64 and digits.num_classes == 10
    assert digits.name == "digits"


def test_digits_dtypes_and_labels(digits):
    assert digits.x_train.dtype == np.float32 and digits.x_test.dtype == np.float32
    assert digits.y_train.dtype == np.int64 and digits.y_test.dtype == np.int64
    assert digits.x_train.flags.c_contiguous and digits.x_test.flags.c_contiguous
    assert set(np.unique(digits.y_train)) == set(range(10)) == set(np.unique(digits.y_test))


def test_digits_standardised_with_training_statistics(digits):
    mean = digits.x_train.mean(axis=0)
    std = digits.x_train.std(axis=0)
    varying = std > 0
    assert varying.sum() > 50  # most pixels vary; a few border pixels are always 0
    np.testing.assert_allclose(mean[varying], 0.0, atol=1e-5)
    np.testing.assert_allclose(std[varying], 1.0, atol=1e-4)
    # Constant pixels become exactly 0 (std replaced by 1, no division by zero).
    assert np.all(digits.x_train[:, ~varying] == 0.0)
    assert np.all(np.isfinite(digits.x_test))
    # The test split is not standardised by its own statistics.
    assert not np.allclose(digits.x_test.mean(axis=0)[varying], 0.0, atol=1e-5)


def test_digits_stratified(digits):
    train_share = np.bincount(digits.y_train, minlength=10) / len(digits.y_train)
    test_share = np.bincount(digits.y_test, minlength=10) / len(digits.y_test)
    np.testing.assert_allclose(train_share, test_share, atol=0.01)


def test_deterministic_for_a_seed(digits):
    again = load_dataset(RunConfig(dataset="digits", seed=0))
    for name in ("x_train", "y_train", "x_test", "y_test"):
        assert np.array_equal(getattr(digits, name), getattr(again, name))
    other = load_dataset(RunConfig(dataset="digits", seed=1))
    assert not np.array_equal(digits.y_train, other.y_train)


def test_test_fraction_respected():
    d = load_dataset(RunConfig(dataset="digits", test_fraction=0.5))
    assert len(d.y_test) == 899 and len(d.y_train) == 898


def test_synthetic_has_configured_shape():
    cfg = RunConfig(dataset="synthetic", synthetic_samples=300, synthetic_features=16, synthetic_classes=3,
                    test_fraction=0.2, seed=5)
    d = load_dataset(cfg)
    assert d.name == "synthetic"
    assert d.x_train.shape == (240, 16) and d.x_test.shape == (60, 16)
    assert d.num_features == 16 and d.num_classes == 3
    assert d.x_train.dtype == np.float32 and d.y_train.dtype == np.int64
    assert set(np.unique(d.y_train)) == {0, 1, 2}
    np.testing.assert_allclose(d.x_train.mean(axis=0), 0.0, atol=1e-5)
    again = load_dataset(cfg)
    assert np.array_equal(d.x_train, again.x_train) and np.array_equal(d.y_test, again.y_test)
    assert not np.array_equal(d.x_train, load_dataset(cfg.replace(seed=6)).x_train)


@pytest.mark.parametrize("fields", [
    {"synthetic_features": 1},
    {"synthetic_features": 8, "synthetic_classes": 20},
    {"synthetic_samples": 20, "test_fraction": 0.05},
])
def test_unusable_synthetic_config_is_a_config_error(fields):
    with pytest.raises(ConfigError):
        load_dataset(RunConfig(dataset="synthetic", **fields))


# --------------------------------------------------------------------------------------------------
# The digits without scikit-learn: the same arrays as load_digits + train_test_split
# --------------------------------------------------------------------------------------------------
def test_digits_file_is_what_load_digits_returns():
    from sklearn.datasets import load_digits

    x, y = load_digits_arrays()
    x_ref, y_ref = load_digits(return_X_y=True)
    assert x.dtype == x_ref.dtype and y.dtype == y_ref.dtype
    assert np.array_equal(x, x_ref) and np.array_equal(y, y_ref)


@pytest.mark.parametrize("seed, test_fraction", [(0, 0.2), (1, 0.2), (7, 0.05), (12345, 0.5), (3, 0.33), (2, 0.9)])
def test_stratified_split_is_scikit_learns(seed, test_fraction):
    from sklearn.model_selection import train_test_split

    x, y = load_digits_arrays()
    ours = stratified_split(x, y, test_fraction, seed)
    ref = train_test_split(x, y, test_size=test_fraction, random_state=seed, stratify=y)
    for a, b in zip(ours, ref):  # same rows in the same order
        assert a.dtype == b.dtype and np.array_equal(a, b)


def test_stratified_split_with_tied_remainders_is_scikit_learns():
    """Classes of equal size: the rounding ties are broken by the same random draws."""
    from sklearn.model_selection import train_test_split

    y = np.repeat(np.arange(7), 13)
    x = np.arange(len(y) * 2, dtype=np.float64).reshape(-1, 2)
    for seed in range(5):
        ours = stratified_split(x, y, 0.3, seed)
        ref = train_test_split(x, y, test_size=0.3, random_state=seed, stratify=y)
        assert all(np.array_equal(a, b) for a, b in zip(ours, ref))


def test_digits_dataset_is_load_digits_and_train_test_split():
    """The whole of load_dataset('digits') against what it computed with scikit-learn before."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    d = load_dataset(RunConfig(dataset="digits", seed=4, test_fraction=0.25))
    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.25, random_state=4, stratify=y)
    mean, std = x_train.mean(axis=0), x_train.std(axis=0)
    std[std == 0] = 1.0
    assert np.array_equal(d.x_train, ((x_train - mean) / std).astype(np.float32))
    assert np.array_equal(d.x_test, ((x_test - mean) / std).astype(np.float32))
    assert np.array_equal(d.y_train, y_train.astype(np.int64)) and np.array_equal(d.y_test, y_test.astype(np.int64))


def test_digits_load_does_not_import_scikit_learn():
    import subprocess
    import sys

    code = ("import sys; from wiiide.config import RunConfig; from wiiide.training.data import load_dataset; "
            "load_dataset(RunConfig(dataset='digits')); print(sorted(m for m in sys.modules if m.startswith('sklearn')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_stratified_split_refusals_are_scikit_learns():
    y = np.array([0, 0, 0, 1])  # class 1 has one member
    with pytest.raises(ValueError, match="least populated class"):
        stratified_split(np.zeros((4, 1)), y, 0.5, 0)


# --------------------------------------------------------------------------------------------------
# BatchSampler
# --------------------------------------------------------------------------------------------------
def test_sampler_covers_an_epoch_without_repeats():
    sampler = BatchSampler(num_samples=100, batch_size=10, seed=3)
    seen = np.concatenate([sampler.next_indices() for _ in range(10)])
    assert sorted(seen.tolist()) == list(range(100))
    assert sampler.epochs_done == 1.0
    second = np.concatenate([sampler.next_indices() for _ in range(10)])
    assert sorted(second.tolist()) == list(range(100))
    assert not np.array_equal(seen, second)  # reshuffled
    assert sampler.epoch == 1


def test_sampler_uneven_batch_drops_the_tail_not_repeats():
    sampler = BatchSampler(num_samples=100, batch_size=32, seed=0)
    first = [sampler.next_indices() for _ in range(3)]
    flat = np.concatenate(first)
    assert len(flat) == 96 and len(set(flat.tolist())) == 96
    assert sampler.epochs_done == pytest.approx(0.96)
    fourth = sampler.next_indices()  # would overrun: a new epoch starts
    assert sampler.epoch == 1 and len(fourth) == 32 and len(set(fourth.tolist())) == 32


def test_sampler_indices_in_range_and_sized():
    sampler = BatchSampler(num_samples=1437, batch_size=32, seed=1)
    for _ in range(200):
        idx = sampler.next_indices()
        assert idx.shape == (32,) and idx.dtype == np.int64
        assert idx.min() >= 0 and idx.max() < 1437


def test_sampler_deterministic_for_a_seed():
    a, b, c = BatchSampler(50, 7, seed=9), BatchSampler(50, 7, seed=9), BatchSampler(50, 7, seed=10)
    run_a = [a.next_indices().tolist() for _ in range(20)]
    assert run_a == [b.next_indices().tolist() for _ in range(20)]
    assert run_a != [c.next_indices().tolist() for _ in range(20)]


def test_sampler_batch_larger_than_data():
    sampler = BatchSampler(num_samples=5, batch_size=32, seed=0)
    assert sampler.batch_size == 5
    assert sorted(sampler.next_indices().tolist()) == [0, 1, 2, 3, 4]
