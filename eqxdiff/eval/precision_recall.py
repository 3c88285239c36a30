"""Improved precision and recall of a generative model (Kynkäänniemi et al. 2019, "Improved
Precision and Recall Metric for Assessing Generative Models"), in feature space (FID's Inception
features).

Each feature set stands for a manifold: the union of balls around its points, each ball's radius
the distance to that point's k-th nearest neighbour in its own set (k = 3 in the paper). Then

    precision = the fraction of generated features inside the real manifold   (fidelity)
    recall    = the fraction of real features inside the generated manifold   (coverage)

A point on the ball's boundary counts as inside (`<=`, as NVlabs' implementation compares). The
paper compares sets of equal size (the radii shrink as a set grows). Distances come from
|a|² + |b|² - 2 a·b in float64, a block of rows at a time, so memory is `batch_size` × n.
"""

import numpy as np
from jaxtyping import Bool, Float


def _squared_distances(a: np.ndarray, b: np.ndarray, b_norms: np.ndarray) -> np.ndarray:
    """|a_i - b_j|² for rows of float64 `a` [m, d] and `b` [n, d] ([m, n]), clipped at 0 (the
    expanded form's round-off can go below)."""
    d2 = (a * a).sum(axis=1)[:, None] + b_norms[None, :] - 2.0 * (a @ b.T)
    return np.maximum(d2, 0.0)


def knn_radii(features: Float[np.ndarray, "n d"], k: int = 3, batch_size: int = 1000) -> Float[np.ndarray, " n"]:
    """Each row's distance to its k-th nearest neighbour among the other rows (float64 [n])."""
    x = np.asarray(features, np.float64)
    if not 1 <= k < len(x):
        raise ValueError(f"k-th nearest neighbours need 1 <= k < the number of feature vectors; k = {k}, n = {len(x)}.")
    norms = (x * x).sum(axis=1)
    radii = np.empty(len(x))
    for start in range(0, len(x), batch_size):
        d2 = _squared_distances(x[start : start + batch_size], x, norms)
        # Index k of each sorted row: index 0 is the point itself (distance 0), 1..k its neighbours.
        radii[start : start + batch_size] = np.partition(d2, k, axis=1)[:, k]
    return np.sqrt(radii)


def within_manifold(
    query: Float[np.ndarray, "m d"],
    support: Float[np.ndarray, "n d"],
    radii: Float[np.ndarray, " n"],
    batch_size: int = 1000,
) -> Bool[np.ndarray, " m"]:
    """Whether each query row lies in some ball around a `support` row: |q - s_j| <= radii[j]."""
    q, s = np.asarray(query, np.float64), np.asarray(support, np.float64)
    if q.shape[1] != s.shape[1]:
        raise ValueError(f"Query features have {q.shape[1]} dimensions, the support's {s.shape[1]}.")
    norms, r2 = (s * s).sum(axis=1), np.asarray(radii, np.float64) ** 2
    inside = np.empty(len(q), bool)
    for start in range(0, len(q), batch_size):
        d2 = _squared_distances(q[start : start + batch_size], s, norms)
        inside[start : start + batch_size] = (d2 <= r2).any(axis=1)
    return inside


def precision_recall(
    real: Float[np.ndarray, "n d"], fake: Float[np.ndarray, "m d"], k: int = 3, batch_size: int = 1000
) -> tuple[float, float]:
    """(precision, recall) of generated features `fake` against real features `real`, both in [0, 1];
    k: the neighbourhood size of the manifold estimates (the paper's 3)."""
    precision = within_manifold(fake, real, knn_radii(real, k, batch_size), batch_size).mean()
    recall = within_manifold(real, fake, knn_radii(fake, k, batch_size), batch_size).mean()
    return float(precision), float(recall)
