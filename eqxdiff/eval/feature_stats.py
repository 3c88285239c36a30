"""FID's statistics: the mean and covariance of feature vectors, accumulated batch by batch (50,000
Inception features never sit in memory), merged across processes, and stored as pytorch-fid's npz.

The covariance is the unbiased one pytorch-fid computes (`np.cov(act, rowvar=False)`, ddof=1).
Sums are kept in float64 about a fixed shift c (the first batch's mean): with y = x - c,

    mean = c + Σy / n,    cov = (Σ y yᵀ - n m mᵀ) / (n - 1),  m = Σy / n.

Unshifted sums of x xᵀ minus n μμᵀ cancel catastrophically when |μ| ≫ std (relative error ~
ε (|μ|/std)²); about c ≈ μ the subtracted term is ~ std²/batch and nothing cancels.
"""

from pathlib import Path

import numpy as np
from jax.experimental import multihost_utils
from jaxtyping import Float


class FeatureStats:
    """Running count, shifted sum and shifted sum of outer products of `dim`-dimensional features.

    `update(features)` adds a batch, `merge(other)` adds another accumulator's (another process's)
    examples, `mean_cov()` gives (mu float64[d], sigma float64[d, d]) as np.mean / np.cov would over
    every example seen. Order of updates changes only round-off.
    """

    def __init__(self, dim: int):
        if dim < 1:
            raise ValueError(f"FeatureStats needs a feature dimension >= 1, got {dim}.")
        self.dim = dim
        self.count = 0
        self.shift = np.zeros(dim)  # c: fixed by the first non-empty batch (its mean)
        self.sum = np.zeros(dim)  # Σ (x - c)
        self.sum_outer = np.zeros((dim, dim))  # Σ (x - c)(x - c)ᵀ

    def update(self, features: Float[np.ndarray, "b d"]) -> "FeatureStats":
        """Add a batch of feature vectors (rows; any float dtype, summed in float64). Returns self."""
        x = np.asarray(features, np.float64)
        if x.shape[1] != self.dim:
            raise ValueError(f"features have {x.shape[1]} dimensions, these statistics {self.dim}: shape {x.shape}.")
        if not np.isfinite(x).all():
            raise ValueError(
                f"features hold {np.count_nonzero(~np.isfinite(x))} NaN/inf values: the feature network's input "
                "or weights are broken; no statistics can be formed from them."
            )
        if len(x) == 0:
            return self
        if self.count == 0:
            self.shift = x.mean(axis=0)
        y = x - self.shift
        self.count += len(x)
        self.sum += y.sum(axis=0)
        self.sum_outer += y.T @ y
        return self

    def merge(self, other: "FeatureStats") -> "FeatureStats":
        """Add `other`'s examples (its sums re-centred on this shift). Returns self."""
        if other.dim != self.dim:
            raise ValueError(
                f"Cannot merge statistics of {other.dim}-dimensional features into {self.dim}-dimensional ones."
            )
        if other.count == 0:
            return self
        if self.count == 0:
            self.shift = other.shift.copy()
        # x - c = (x - c') + δ with δ = c' - c: Σ(x-c) = Σ' + nδ, Σ(x-c)(x-c)ᵀ = Σ'' + δΣ'ᵀ + Σ'δᵀ + nδδᵀ.
        delta = other.shift - self.shift
        n = other.count
        self.sum += other.sum + n * delta
        self.sum_outer += (
            other.sum_outer + np.outer(delta, other.sum) + np.outer(other.sum, delta) + n * np.outer(delta, delta)
        )
        self.count += n
        return self

    def mean_cov(self) -> tuple[Float[np.ndarray, " d"], Float[np.ndarray, "d d"]]:
        """(mu, sigma), float64: the mean and the unbiased (n - 1) covariance of every example added."""
        if self.count < 2:
            raise ValueError(f"A covariance needs at least 2 feature vectors; these statistics hold {self.count}.")
        m = self.sum / self.count
        cov = (self.sum_outer - self.count * np.outer(m, m)) / (self.count - 1)
        return self.shift + m, (cov + cov.T) / 2  # symmetric bit for bit: eigh reads one triangle


def gather_feature_stats(stats: FeatureStats) -> FeatureStats:
    """Every JAX process's partial statistics merged in process order, the same on every process
    (a collective: all processes call it). With one process, a merged copy of `stats`.

    The sums travel as uint32 words: process_allgather puts them on devices, where float64 would
    become float32 unless jax_enable_x64 is on. Each process sends d² + 2d + 1 float64 numbers
    (32 MB for Inception's d = 2048)."""
    words = {
        "count": np.array([stats.count], np.int64).view(np.uint32),
        **{
            k: np.ascontiguousarray(getattr(stats, k), np.float64).view(np.uint32)
            for k in ("shift", "sum", "sum_outer")
        },
    }
    gathered = multihost_utils.process_allgather(words)  # each leaf gains a leading process axis
    merged = FeatureStats(stats.dim)
    for p in range(gathered["count"].shape[0]):
        part = FeatureStats(stats.dim)
        part.count = int(gathered["count"][p].view(np.int64)[0])
        for k in ("shift", "sum", "sum_outer"):
            setattr(part, k, np.ascontiguousarray(gathered[k][p]).view(np.float64))
        merged.merge(part)
    return merged


def save_stats(path: str | Path, mu: Float[np.ndarray, " d"], sigma: Float[np.ndarray, "d d"]) -> None:
    """Write pytorch-fid's statistics file: an .npz with float64 `mu` [d] and `sigma` [d, d], the
    file its `--save-stats` writes and `fid_score` reads in place of a folder of images."""
    path = Path(path)
    if path.suffix != ".npz":
        raise ValueError(f"{path}: name statistics files *.npz; pytorch-fid reads a path as statistics only then.")
    _check_shapes(path, np.shape(mu), np.shape(sigma))
    tmp = path.with_name(path.name + ".tmp")  # whole or not at all: a rename
    with open(tmp, "wb") as f:  # a file object: np.savez would append .npz to a path
        np.savez_compressed(f, mu=np.asarray(mu, np.float64), sigma=np.asarray(sigma, np.float64))
    tmp.replace(path)


def load_stats(path: str | Path, dim: int | None = None) -> tuple[Float[np.ndarray, " d"], Float[np.ndarray, "d d"]]:
    """(mu, sigma) as float64 from a pytorch-fid statistics .npz (pytorch-fid's own files store mu
    as float32). `dim`: the feature dimension expected (2048 for Inception's pool3); a file of
    other features is an error, as are missing keys, mismatched shapes and NaN/inf."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(
            f"No statistics file {path}; write one with train/fid_stats.py or pytorch-fid --save-stats."
        )
    try:
        f = np.load(path, allow_pickle=False)
    except (OSError, EOFError, ValueError) as e:  # not a zip or .npy at all (text reads as "pickled data")
        raise ValueError(f"{path} is not an .npz statistics file ({e}).") from e
    if not isinstance(f, np.lib.npyio.NpzFile):
        raise ValueError(f"{path} is not an .npz statistics file: it holds one array, {f.dtype} {f.shape} (an .npy).")
    with f:
        missing = [k for k in ("mu", "sigma") if k not in f.files]
        if missing:
            raise ValueError(
                f"{path} lacks {' and '.join(map(repr, missing))} (it holds {sorted(f.files)}); FID statistics "
                "files hold 'mu' [d] and 'sigma' [d, d], as pytorch-fid writes them."
            )
        mu, sigma = np.asarray(f["mu"], np.float64), np.asarray(f["sigma"], np.float64)
    _check_shapes(path, mu.shape, sigma.shape)
    if dim is not None and mu.shape[0] != dim:
        raise ValueError(f"{path} holds statistics of {mu.shape[0]}-dimensional features; {dim} are expected here.")
    for name, a in (("mu", mu), ("sigma", sigma)):
        if not np.isfinite(a).all():
            raise ValueError(f"{path}: {name} holds NaN/inf values.")
    return mu, sigma


def _check_shapes(path: Path, mu_shape: tuple, sigma_shape: tuple) -> None:
    """mu [d] and sigma [d, d], else a ValueError naming both shapes."""
    if len(mu_shape) != 1 or sigma_shape != (*mu_shape, *mu_shape):
        raise ValueError(f"{path}: mu has shape {mu_shape} and sigma {sigma_shape}; they must be [d] and [d, d].")
