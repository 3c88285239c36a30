"""Sample quality for the 8×8 digits job, scored against scikit-learn's bundled digits.

The 1,797 real digits are split once, stratified 50/50 with random_state=0 (`digits_split`). The
train split fits the independent judges: an RBF SVC (classifier) and a 30-component PCA (FD
features). The test split plays "perfect samples": every figure is computed for the samples AND
for a held-out set of real test digits with the same class counts (the `*_real` keys), so each
sample number sits next to the value real digits get (a ceiling, a floor, or ≈ 1).

Distances are Euclidean over the 64 pixels in the model's [-1, 1] scale (one pixel step of the
0..16 data is 0.125). Images are NHWC (n, 8, 8, 1), either
  - float in [-1, 1]: real pixel v ∈ 0..16 ↦ v/16·2 - 1 (what the trainer samples); values within
    ±1.5 are accepted and clipped to [-1, 1] like `eqxdiff.images.to_uint8`, or
  - uint8 in 0..255: v ↦ round(v·255/16) (what `to_uint8` writes); read back as u/127.5 - 1.
"""

import dataclasses
import functools

import numpy as np
from jaxtyping import ArrayLike, Float, Int, UInt8
from scipy.spatial.distance import pdist

from eqxdiff.eval.frechet import frechet_distance, gaussian_stats

NUM_CLASSES = 10
SPLIT_SEED = 0
PCA_DIM = 30  # 96% of the train split's pixel variance; all 64 pixels give a singular covariance
COPY_PERCENTILE = 5.0  # a sample is a "copy" if closer to a training image than 95% of real digits are
_OVERSHOOT = 1.5  # floats beyond ±1.5 are a wrong scale (0..16, 0..255), not sampler overshoot


@dataclasses.dataclass(frozen=True, eq=False)
class _Reference:
    """The real digits (pixels (n, 64) in [-1, 1]) and the judges fitted on the train split."""

    train_x: np.ndarray
    train_y: np.ndarray
    test_x: np.ndarray
    test_y: np.ndarray
    classifier: object  # sklearn SVC
    pca: object  # sklearn PCA
    train_features: np.ndarray  # (n_train, PCA_DIM)
    train_spread: np.ndarray  # (10,) mean pairwise distance within each class of the train split
    nn_train: object  # NearestNeighbors over the train split
    nn_all: object  # NearestNeighbors over all 1,797 digits
    test_nn_train: np.ndarray  # each test digit's distance to its nearest train-split digit
    test_nn_all_loo: np.ndarray  # each test digit's distance to its nearest OTHER digit of all 1,797


_Split = tuple[Float[np.ndarray, "n 64"], Int[np.ndarray, " n"], Float[np.ndarray, "m 64"], Int[np.ndarray, " m"]]


def _split() -> _Split:
    """The fixed stratified 50/50 split (random_state=0) as flat float64 pixels in [-1, 1] and labels."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = (digits.images.reshape(-1, 64) / 16.0 * 2 - 1).astype(np.float64)
    y = digits.target.astype(np.int64)
    train_x, test_x, train_y, test_y = train_test_split(x, y, test_size=0.5, stratify=y, random_state=SPLIT_SEED)
    return train_x, train_y, test_x, test_y


@functools.lru_cache(maxsize=1)
def _reference() -> _Reference:
    """Fit the judges once per process (a PCA and neighbour index over the train split)."""
    from sklearn.decomposition import PCA
    from sklearn.neighbors import NearestNeighbors
    from sklearn.svm import SVC

    train_x, train_y, test_x, test_y = _split()
    all_x = np.concatenate([train_x, test_x])
    pca = PCA(n_components=PCA_DIM, random_state=SPLIT_SEED).fit(train_x)
    nn_all = NearestNeighbors(n_neighbors=2).fit(all_x)
    nn_train = NearestNeighbors(n_neighbors=1).fit(train_x)
    return _Reference(
        train_x=train_x,
        train_y=train_y,
        test_x=test_x,
        test_y=test_y,
        classifier=SVC(gamma="scale").fit(train_x, train_y),  # 98.3% on the test split
        pca=pca,
        train_features=pca.transform(train_x),
        train_spread=np.array([pdist(train_x[train_y == c]).mean() for c in range(NUM_CLASSES)]),
        nn_train=nn_train,
        nn_all=nn_all,
        test_nn_train=nn_train.kneighbors(test_x)[0][:, 0],
        test_nn_all_loo=nn_all.kneighbors(test_x)[0][:, 1],  # [:, 0] is the digit itself
    )


def digits_split() -> tuple[
    Float[np.ndarray, "n 8 8 1"], Int[np.ndarray, " n"], Float[np.ndarray, "m 8 8 1"], Int[np.ndarray, " m"]
]:
    """The fixed real split (898 train, 899 test), as [-1, 1] float32 NHWC images and labels:
    (train_images, train_labels, test_images, test_labels)."""
    train_x, train_y, test_x, test_y = _split()
    as_images = lambda x: x.astype(np.float32).reshape(-1, 8, 8, 1)  # noqa: E731
    return as_images(train_x), train_y, as_images(test_x), test_y


def _pixels(
    images: Float[np.ndarray, "n 8 8 1"] | UInt8[np.ndarray, "n 8 8 1"],
) -> Float[np.ndarray, "n 64"]:
    """NHWC images in either documented encoding -> flat float64 pixels in [-1, 1]."""
    if images.dtype == np.uint8:
        return images.reshape(len(images), 64) / 127.5 - 1.0
    return np.clip(images.reshape(len(images), 64).astype(np.float64), -1.0, 1.0)


def _check(images: ArrayLike, labels: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
    """Validate the inputs with messages that name the fix (before any model is fitted)."""
    images, labels = np.asarray(images), np.asarray(labels)
    if images.ndim != 4 or images.shape[1:] != (8, 8, 1):
        raise ValueError(f"images must be NHWC digits of shape (n, 8, 8, 1), got {images.shape}.")
    if images.dtype != np.uint8 and not np.issubdtype(images.dtype, np.floating):
        raise ValueError(
            f"images must be float in [-1, 1] (v/16*2-1) or uint8 in 0..255 (v*255/16), got {images.dtype}."
        )
    if np.issubdtype(images.dtype, np.floating):
        if not np.all(np.isfinite(images)):
            raise ValueError("images contain NaN or inf.")
        if np.abs(images).max(initial=0.0) > _OVERSHOOT:
            raise ValueError(
                f"float images must lie in [-1, 1] (0..16 data maps to v/16*2-1), got values in "
                f"[{images.min():.3g}, {images.max():.3g}]; for 0..255 pixels pass uint8."
            )
    if labels.shape != (len(images),) or not np.issubdtype(labels.dtype, np.integer):
        raise ValueError(f"labels must be integers of shape ({len(images)},), got {labels.dtype} {labels.shape}.")
    if labels.size and (labels.min() < 0 or labels.max() >= NUM_CLASSES):
        raise ValueError(f"labels must be digit classes 0..9, got values in [{labels.min()}, {labels.max()}].")
    if np.bincount(labels, minlength=NUM_CLASSES).max(initial=0) < 2:
        raise ValueError("need at least 2 images of some class (diversity and covariances use pairs).")
    return images, labels.astype(np.int64)


@functools.lru_cache(maxsize=64)
def _real_rows(counts: tuple[int, ...]) -> np.ndarray:
    """Test-split rows with `counts[c]` digits of class c (capped at the ~90 the split holds),
    a seeded choice so the real figures are the same on every rerun."""
    ref = _reference()
    rng = np.random.default_rng(SPLIT_SEED)
    rows = [rng.permutation(np.flatnonzero(ref.test_y == c))[:n] for c, n in enumerate(counts)]
    return np.concatenate(rows)


def _figures(
    x: Float[np.ndarray, "n 64"], y: Int[np.ndarray, " n"], nn: Float[np.ndarray, " n"], copy_below: float
) -> dict[str, float]:
    """Every per-set figure for pixels `x` with requested labels `y` and nearest-training distances `nn`."""
    ref = _reference()
    counts = np.bincount(y, minlength=NUM_CLASSES)
    spread = [(counts[c], pdist(x[y == c]).mean() / ref.train_spread[c]) for c in range(NUM_CLASSES) if counts[c] >= 2]
    # FD reference: the train split reweighted to this set's class mix, so an unbalanced request is not penalised
    train_counts = np.bincount(ref.train_y, minlength=NUM_CLASSES)
    weights = (counts / train_counts)[ref.train_y]
    return {
        "class_accuracy": float(np.mean(ref.classifier.predict(x) == y)),
        "diversity_ratio": float(sum(n * r for n, r in spread) / sum(n for n, _ in spread)),
        "nn_distance": float(np.median(nn)),
        "copy_fraction": float(np.mean(nn < copy_below)),
        "fd": frechet_distance(*gaussian_stats(ref.pca.transform(x)), *gaussian_stats(ref.train_features, weights)),
    }


def digits_sample_metrics(images: ArrayLike, labels: ArrayLike, trained_on: str = "all") -> dict[str, float]:
    """Score class-conditional samples `images` (n, 8, 8, 1) generated for `labels` (n,).

    `trained_on` says which real digits the model saw: "all" 1,797 (what train/main.py does) or the
    "train" split of `digits_split()`. Each key below has a `*_real` twin: the same figure for real
    test digits with the same class counts (capped at ~90 per class), scored exactly like samples.

    - class_accuracy: fraction the train-split SVC assigns to the requested label; real = ceiling (~0.98).
      Says (a): recognisably digits of the requested class.
    - diversity_ratio: per class, mean pairwise pixel distance of the set / of the train split's digits
      of that class, averaged weighted by count. ≈ 1 as varied as real digits, → 0 mode collapse,
      > 1 noisier than real. Says (b).
    - nn_distance: median distance to the nearest training image (all digits, or the train split). The
      real twin is the figure for unseen digits: with "all" each real digit's nearest OTHER digit
      (leave-one-out), with "train" the test digits' nearest train-split digit.
      nn_ratio = nn_distance / nn_distance_real: ≈ 1 not copying, → 0 copies. Says (c).
    - copy_fraction: fraction of the set closer to a training image than the 5th percentile of the
      real figure (≈ 0.05 for real digits by construction; 1 for copies).
    - fd: Fréchet distance (squared pixel units) between the set's and the train split's features
      (30-d PCA fitted on the train split, train weighted to the set's class mix); real = floor, the
      FD of real test digits at the same sample size and class mix. Grows as n shrinks.
    Also "n", the number of samples. Validates shapes, dtype and range (ValueError) first.
    """
    if trained_on not in ("all", "train"):
        raise ValueError(
            f'trained_on must be "all" (every real digit) or "train" (the train split), got {trained_on!r}.'
        )
    images, labels = _check(images, labels)
    x, ref = _pixels(images), _reference()
    rows = _real_rows(tuple(int(c) for c in np.bincount(labels, minlength=NUM_CLASSES)))
    if trained_on == "all":
        nn, nn_real = ref.nn_all.kneighbors(x, 1)[0][:, 0], ref.test_nn_all_loo[rows]
    else:
        nn, nn_real = ref.nn_train.kneighbors(x)[0][:, 0], ref.test_nn_train[rows]
    copy_below = float(np.percentile(nn_real, COPY_PERCENTILE))
    samples = _figures(x, labels, nn, copy_below)
    real = _figures(ref.test_x[rows], ref.test_y[rows], nn_real, copy_below)
    out = {"n": float(len(x))}
    for key in samples:
        out[key], out[f"{key}_real"] = samples[key], real[key]
    out["nn_ratio"] = samples["nn_distance"] / real["nn_distance"]
    return out


def format_metrics(metrics: dict[str, float]) -> str:
    """A table of `digits_sample_metrics` output a person reads: one row per figure, the samples next to
    real held-out digits scored the same way, and what the figure means with which way is better."""
    notes = {
        "class_accuracy": "classified as the asked digit; higher is better, real is the ceiling",
        "diversity_ratio": "spread within a class / real's; near 1 is better, 0 = one image per class",
        "nn_distance": f"to the nearest training digit (ratio {metrics['nn_ratio']:.2f}); near real, 0 = copies",
        "copy_fraction": f"closer to a training digit than {100 - COPY_PERCENTILE:g}% of real are; lower is better",
        "fd": "Fréchet distance of PCA features to real; lower is better, real is the floor at this n",
    }
    lines = [f"{'n=' + str(int(metrics['n'])):<16}{'samples':>9}{'real':>9}"]
    lines += [f"{k:<16}{metrics[k]:>9.3f}{metrics[k + '_real']:>9.3f}  {note}" for k, note in notes.items()]
    return "\n".join(lines)


def two_digit_accuracy(images: ArrayLike, digits: ArrayLike) -> dict[str, float]:
    """Score two-digit samples of `captioned_digits`: `images` (n, 8, 16, 1) in either encoding of this module
    (uint8 0..255 or float in [-1, 1]), `digits` (n, 2) the (left, right) digit classes each was asked for.

    The train-split SVC (the classifier of `digits_sample_metrics`) reads each 8×8 half on its own: "left" and
    "right" are the fractions of halves it assigns to the requested digit, "both" the fraction of images with
    both halves right. Real test digits score ~0.98 per half."""
    images, digits = np.asarray(images), np.asarray(digits)
    if images.ndim != 4 or images.shape[1:] != (8, 16, 1) or len(images) == 0:
        raise ValueError(f"images must be NHWC pairs of digits side by side, (n, 8, 16, 1), got {images.shape}.")
    if images.dtype != np.uint8 and not np.issubdtype(images.dtype, np.floating):
        raise ValueError(f"images must be float in [-1, 1] or uint8 in 0..255, got {images.dtype}.")
    if np.issubdtype(images.dtype, np.floating) and not (
        np.all(np.isfinite(images)) and np.abs(images).max(initial=0.0) <= _OVERSHOOT
    ):
        raise ValueError("float images must be finite and lie in [-1, 1]; for 0..255 pixels pass uint8.")
    if digits.shape != (len(images), 2) or not np.issubdtype(digits.dtype, np.integer):
        raise ValueError(f"digits must be integers of shape ({len(images)}, 2), got {digits.dtype} {digits.shape}.")
    if digits.size and (digits.min() < 0 or digits.max() >= NUM_CLASSES):
        raise ValueError(f"digits must be classes 0..9, got values in [{digits.min()}, {digits.max()}].")
    classifier = _reference().classifier
    correct = np.stack(
        [
            classifier.predict(_pixels(images[:, :, half])) == digits[:, k]
            for k, half in enumerate((slice(0, 8), slice(8, 16)))
        ],
        axis=1,
    )
    left, right = correct.mean(axis=0)
    return {"left": float(left), "right": float(right), "both": float(correct.all(axis=1).mean())}
