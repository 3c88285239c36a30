"""Sample-quality metrics: the Fréchet distance against closed forms, and the digits scorecard on
inputs whose verdict is known (real held-out digits, copies, noise, mode collapse, wrong labels)."""

import jax.numpy as jnp
import numpy as np
import pytest
import scipy.linalg
from jaxtyping import TypeCheckError

from eqxdiff.eval import (
    digits_sample_metrics,
    digits_split,
    format_metrics,
    frechet_distance,
    frechet_distance_features,
)


def _spd(rng, d):
    a = rng.normal(size=(d, d))
    return a @ a.T / d + 0.1 * np.eye(d)


def test_frechet_diagonal_closed_form():
    # Diagonal covariances commute, so (Σ1Σ2)^½ is the elementwise sqrt of the product.
    rng = np.random.default_rng(0)
    mu1, mu2, a, b = rng.normal(size=5), rng.normal(size=5), rng.uniform(0.1, 3, 5), rng.uniform(0.1, 3, 5)
    expected = np.sum((mu1 - mu2) ** 2) + np.sum((np.sqrt(a) - np.sqrt(b)) ** 2)
    assert frechet_distance(mu1, np.diag(a), mu2, np.diag(b)) == pytest.approx(expected, rel=1e-10)


def test_frechet_full_covariance_matches_sqrtm_and_scaling():
    rng = np.random.default_rng(1)
    mu1, mu2, cov1, cov2 = rng.normal(size=6), rng.normal(size=6), _spd(rng, 6), _spd(rng, 6)
    # The textbook formula with scipy's matrix square root (well-conditioned case, real result).
    textbook = np.sum((mu1 - mu2) ** 2) + np.trace(cov1 + cov2 - 2 * scipy.linalg.sqrtm(cov1 @ cov2).real)
    assert frechet_distance(mu1, cov1, mu2, cov2) == pytest.approx(textbook, rel=1e-8)
    # Σ2 = c²Σ1 gives tr(Σ1 + c²Σ1 - 2cΣ1) = (1 - c)² tr Σ1.
    assert frechet_distance(mu1, cov1, mu1, 9.0 * cov1) == pytest.approx(4.0 * np.trace(cov1), rel=1e-10)
    assert frechet_distance(mu1, cov1, mu2, cov2) == pytest.approx(frechet_distance(mu2, cov2, mu1, cov1), rel=1e-10)


def test_frechet_singular_covariance_is_finite_and_exact():
    # A point mass (what a fully collapsed sampler produces) against N(mu2, Σ2): |Δμ|² + tr Σ2.
    rng = np.random.default_rng(2)
    mu1, mu2, cov2 = rng.normal(size=4), rng.normal(size=4), _spd(rng, 4)
    fd = frechet_distance(mu1, np.zeros((4, 4)), mu2, cov2)
    assert fd == pytest.approx(np.sum((mu1 - mu2) ** 2) + np.trace(cov2), rel=1e-10)


def test_frechet_features_zero_on_identical_and_close_to_population_value():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(300, 5)) @ rng.normal(size=(5, 5))
    assert frechet_distance_features(x, x) == pytest.approx(0.0, abs=1e-9)
    # Large samples from N(0, diag(1,4,9)) and N(1, diag(4,4,4)): closed form 3 + (1 + 0 + 1) = 5.
    a = rng.normal(size=(200_000, 3)) * np.array([1.0, 2.0, 3.0])
    b = rng.normal(size=(200_000, 3)) * 2.0 + 1.0
    assert frechet_distance_features(a, b) == pytest.approx(5.0, rel=0.02)
    assert frechet_distance_features(a, b) == pytest.approx(frechet_distance_features(b, a), rel=1e-8)


def test_eval_shapes_are_checked_by_jaxtyping():
    # A (3,) mean with a (4, 4) covariance is a shape error caught by the hook, not by numpy later.
    with pytest.raises(TypeCheckError):
        frechet_distance(np.zeros(3), np.eye(4), np.zeros(3), np.eye(4))


@pytest.fixture(scope="module")
def split():
    return digits_split()


@pytest.fixture(scope="module")
def held_out(split):
    """50 test digits per class, chosen with a different seed than the metric's own real set."""
    _, _, test_x, test_y = split
    rng = np.random.default_rng(123)
    rows = np.concatenate([rng.permutation(np.flatnonzero(test_y == c))[:50] for c in range(10)])
    return test_x[rows], test_y[rows]


def test_split_is_fixed_and_stratified(split):
    train_x, train_y, test_x, test_y = split
    assert (len(train_x), len(test_x)) == (898, 899)
    assert train_x.shape[1:] == (8, 8, 1) and train_x.min() == -1.0 and train_x.max() == 1.0
    assert np.abs(np.bincount(train_y) - np.bincount(test_y)).max() <= 1
    assert np.array_equal(digits_split()[1], train_y)  # same split on every call


def test_held_out_real_digits_score_like_real_digits(held_out):
    m = digits_sample_metrics(*held_out, trained_on="train")
    assert m["class_accuracy_real"] > 0.95  # the ceiling is a strong classifier
    assert m["class_accuracy"] > 0.95 and abs(m["class_accuracy"] - m["class_accuracy_real"]) < 0.03
    assert 0.9 < m["nn_ratio"] < 1.1 and m["copy_fraction"] < 0.1
    assert 0.9 < m["diversity_ratio"] < 1.1 and 0.9 < m["diversity_ratio_real"] < 1.1
    assert m["fd"] < 1.5 * m["fd_real"] and m["fd_real"] < 0.5
    # uint8 input (v ↦ round(v·255/16)) and device arrays give the same verdict as [-1, 1] floats.
    as_uint8 = np.round((held_out[0] + 1) * 8 * 255 / 16).astype(np.uint8)
    as_device = (jnp.asarray(held_out[0]), jnp.asarray(held_out[1]))
    for other in (digits_sample_metrics(as_uint8, held_out[1], "train"), digits_sample_metrics(*as_device, "train")):
        for key in ("class_accuracy", "diversity_ratio", "nn_distance", "fd"):
            assert other[key] == pytest.approx(m[key], rel=0.02)


def test_digits_the_model_saw_are_copies_when_trained_on_all(held_out):
    # train/main.py fits all 1,797 digits, so a held-out test digit is a training image to it.
    m = digits_sample_metrics(*held_out, trained_on="all")
    assert m["nn_ratio"] == 0.0 and m["copy_fraction"] == 1.0
    assert m["nn_distance_real"] > 1.5  # leave-one-out: a real digit's nearest OTHER digit is ~2 away
    assert 0.02 < m["copy_fraction_real"] < 0.08  # 5th percentile threshold, by construction


@pytest.mark.parametrize("trained_on", ["all", "train"])
def test_copies_of_training_images_are_flagged(split, trained_on):
    train_x, train_y, _, _ = split
    m = digits_sample_metrics(train_x[:500], train_y[:500], trained_on=trained_on)
    assert m["nn_ratio"] < 0.05 and m["copy_fraction"] == 1.0
    # Near-copies (0.05 pixel jitter, ~0.4 in distance) are still caught.
    jitter = np.random.default_rng(0).normal(0, 0.05, train_x[:500].shape).astype(np.float32)
    near = digits_sample_metrics(np.clip(train_x[:500] + jitter, -1, 1), train_y[:500], trained_on=trained_on)
    assert near["nn_ratio"] < 0.3 and near["copy_fraction"] > 0.9


def test_noise_is_not_digits():
    labels = np.arange(500) % 10
    noise = np.random.default_rng(0).uniform(-1, 1, (500, 8, 8, 1))
    m = digits_sample_metrics(noise, labels)
    assert m["class_accuracy"] < 0.3 and m["class_accuracy_real"] > 0.95
    assert m["fd"] > 10 * m["fd_real"]
    assert m["nn_ratio"] > 2 and m["copy_fraction"] == 0.0


def test_one_image_per_class_is_mode_collapse(split):
    train_x, train_y, _, _ = split
    means = np.stack([train_x[train_y == c].mean(0) for c in range(10)])
    labels = np.arange(500) % 10
    m = digits_sample_metrics(means[labels], labels)
    assert m["class_accuracy"] > 0.9  # the class means are clearly the right digits ...
    assert m["diversity_ratio"] < 0.05  # ... but every sample of a class is the same image
    assert m["fd"] > 5 * m["fd_real"]


def test_wrong_labels_give_low_accuracy(held_out):
    images, labels = held_out
    assert digits_sample_metrics(images, (labels + 1) % 10, "train")["class_accuracy"] < 0.1


def test_fd_follows_the_requested_class_mix(split):
    # Only 3s requested: the reference is the train split's 3s, so real 3s sit near the floor.
    _, _, test_x, test_y = split
    threes = test_x[test_y == 3][::2]
    m = digits_sample_metrics(threes, np.full(len(threes), 3), "train")
    assert m["class_accuracy"] > 0.95 and m["fd"] < 2 * m["fd_real"]
    noise = np.random.default_rng(0).uniform(-1, 1, threes.shape)
    assert digits_sample_metrics(noise, np.full(len(threes), 3), "train")["fd"] > 10 * m["fd_real"]


@pytest.mark.parametrize(
    ("images", "labels", "match"),
    [
        (np.zeros((10, 8, 8)), np.arange(10), "shape"),
        (np.zeros((10, 1, 8, 8)), np.arange(10), "shape"),
        (np.full((10, 8, 8, 1), 16.0), np.arange(10), r"\[-1, 1\]"),
        (np.full((10, 8, 8, 1), np.nan), np.arange(10), "NaN"),
        (np.zeros((10, 8, 8, 1), np.int64), np.arange(10), "uint8"),
        (np.zeros((10, 8, 8, 1)), np.arange(9), "labels"),
        (np.zeros((10, 8, 8, 1)), np.arange(10) + 1, "0..9"),
        (np.zeros((10, 8, 8, 1)), np.arange(10) * 1.0, "integers"),
        (np.zeros((10, 8, 8, 1)), np.arange(10), "at least 2"),
    ],
)
def test_bad_inputs_raise_clear_errors(images, labels, match):
    with pytest.raises(ValueError, match=match):
        digits_sample_metrics(images, labels)


def test_unknown_training_set_is_an_error(held_out):
    with pytest.raises(ValueError, match="trained_on"):
        digits_sample_metrics(*held_out, trained_on="test")


def test_format_metrics_lists_every_figure_with_its_real_value(held_out):
    m = digits_sample_metrics(*held_out, trained_on="train")
    table = format_metrics(m)
    lines = table.splitlines()
    assert len(lines) == 6 and lines[0].startswith("n=500")
    for key in ("class_accuracy", "diversity_ratio", "nn_distance", "copy_fraction", "fd"):
        (row,) = [line for line in lines if line.startswith(key + " ")]
        assert f"{m[key]:.3f}" in row and f"{m[key + '_real']:.3f}" in row
    assert f"ratio {m['nn_ratio']:.2f}" in table
