"""Fréchet distance between Gaussians fitted to two feature sets (the formula behind FID)."""

import numpy as np
from jaxtyping import Float


def gaussian_stats(
    features: Float[np.ndarray, "n d"], weights: Float[np.ndarray, " n"] | None = None
) -> tuple[Float[np.ndarray, " d"], Float[np.ndarray, "d d"]]:
    """Mean and covariance of `features` (rows are samples), optionally with per-row `weights`
    (np.cov's `aweights`); n ≥ 2."""
    mean = np.average(features, axis=0, weights=weights)
    cov = np.atleast_2d(np.cov(features, rowvar=False, aweights=weights))
    return mean, cov


def frechet_distance(
    mu1: Float[np.ndarray, " d"],
    cov1: Float[np.ndarray, "d d"],
    mu2: Float[np.ndarray, " d"],
    cov2: Float[np.ndarray, "d d"],
) -> float:
    """Squared Fréchet (2-Wasserstein) distance between N(mu1, cov1) and N(mu2, cov2):

        |mu1 - mu2|² + tr(cov1 + cov2 - 2 (cov1 cov2)^½)        (Dowson & Landau 1982; FID: Heusel et al. 2017)

    Units: squared feature units. tr((cov1 cov2)^½) is computed as Σ √λ over the eigenvalues λ of the
    symmetric PSD matrix cov1^½ cov2 cov1^½ (same spectrum as cov1 cov2), not with scipy.linalg.sqrtm:
    sqrtm of a singular product (mode-collapsed samples have rank-deficient covariances) warns and
    returns complex values, while this form stays real and exact.
    """
    diff = mu1 - mu2
    w, v = np.linalg.eigh(cov1)
    root1 = (v * np.sqrt(np.clip(w, 0.0, None))) @ v.T
    lam = np.linalg.eigvalsh(root1 @ cov2 @ root1)
    tr_covmean = np.sqrt(np.clip(lam, 0.0, None)).sum()  # clip: round-off makes zero eigenvalues ±1e-17
    fd = diff @ diff + np.trace(cov1) + np.trace(cov2) - 2.0 * tr_covmean
    return float(max(fd, 0.0))  # identical sets give ±1e-13 of round-off, never a real negative


def frechet_distance_features(x: Float[np.ndarray, "n d"], y: Float[np.ndarray, "m d"]) -> float:
    """Fréchet distance between Gaussians fitted to two feature sets (rows are samples, n, m ≥ 2)."""
    return frechet_distance(*gaussian_stats(x), *gaussian_stats(y))
