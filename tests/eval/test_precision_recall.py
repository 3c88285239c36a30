"""Improved precision and recall (Kynkäänniemi et al. 2019) on configurations worked out by hand,
the k-NN radii against sorted exact distances, and the limits: identical sets 1, far sets 0."""

import numpy as np
import pytest
from jaxtyping import TypeCheckError

from eqxdiff.eval import knn_radii, precision_recall, within_manifold  # shape-checked (conftest)


def column(*values):
    return np.array(values, np.float64)[:, None]  # points on a line, as [n, 1] features


def test_hand_worked_line_k1():
    # k = 1: each real point's ball has radius 1 (its neighbour is 1 away).
    real = column(0, 1, 2, 3)
    fake = column(-1.5, 0.5, 4.6, 6)
    np.testing.assert_allclose(knn_radii(real, k=1), [1, 1, 1, 1])
    np.testing.assert_allclose(knn_radii(fake, k=1), [2, 2, 1.4, 1.4])
    # Inside the real balls: only 0.5 (-1.5 is 1.5 from 0, 4.6 is 1.6 from 3, 6 is 3 from 3).
    # Inside the fake balls: 0 (1.5 from -1.5, radius 2), 1 and 2 (0.5 and 1.5 from 0.5, radius 2);
    # not 3 (1.6 from 4.6, radius 1.4; 2.5 from 0.5, radius 2).
    assert within_manifold(fake, real, knn_radii(real, k=1)).tolist() == [False, True, False, False]
    assert precision_recall(real, fake, k=1) == (0.25, 0.75)


def test_hand_worked_line_k3():
    # k = 3, the paper's: radii are the 3rd-nearest distances, 10's is 9 (to 1), so the real
    # manifold reaches [1, 19] there; of the fakes only 5 lies in it. The fakes are so spread out
    # that their radii (28.5, 20, 23.5, 28.5) cover every real point.
    real, fake = column(0, 1, 2, 3, 10), column(-3.5, 5, 20, 25)
    np.testing.assert_allclose(knn_radii(real), [3, 2, 2, 3, 9])
    np.testing.assert_allclose(knn_radii(fake), [28.5, 20, 23.5, 28.5])
    assert precision_recall(real, fake) == (0.25, 1.0)


def test_radii_equal_sorted_exact_distances_in_any_batch_size():
    x = np.random.default_rng(0).normal(size=(37, 5)) * 3 + 100  # an offset: the expanded form's worst case
    exact = np.sort(np.linalg.norm(x[:, None] - x[None], axis=-1), axis=1)  # column 0: the point itself
    for batch_size in (7, 1000):
        for k in (1, 3):
            np.testing.assert_allclose(knn_radii(x, k, batch_size), exact[:, k], rtol=1e-9)


def test_identical_sets_score_one_and_far_apart_sets_zero():
    x = np.random.default_rng(1).normal(size=(50, 8)).astype(np.float32)
    assert precision_recall(x, x) == (1.0, 1.0)
    assert precision_recall(x, x + 100) == (0.0, 0.0)  # radii ~3: no ball reaches 100 away
    # Half the fakes on real points, half far away: precision 1/2, and those real points are covered.
    fake = np.concatenate([x[:25], x[:25] + 100])
    precision, recall = precision_recall(x, fake)
    assert precision == 0.5 and recall >= 0.5


def test_too_few_points_and_mismatched_dimensions_are_errors():
    with pytest.raises(ValueError, match="k = 3, n = 3"):
        knn_radii(column(0, 1, 2))
    with pytest.raises(TypeCheckError):  # (ValueError without the shape checks of the tests)
        within_manifold(np.zeros((2, 2)), column(0, 1), np.ones(2))
