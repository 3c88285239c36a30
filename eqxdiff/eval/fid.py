"""FID of a model's samples against a dataset's reference statistics (Heusel et al. 2017), and
Kynkäänniemi et al.'s precision and recall when the reference keeps some of its features.

The samples are made and streamed through the feature network a chunk at a time (50,000 images
never sit in memory): every process samples each chunk (the model may be sharded over all of
them), runs its own share of the chunk's rows over its own devices, and adds the features to its
float64 sums (FeatureStats), merged across processes at the end. Precision and recall need
feature vectors, not only (mu, sigma): a fixed random subset of rows is kept while streaming
(KeptFeatures), as train/fid_stats.py --keep_features keeps one of the dataset's in the reference
file (key `features`, which pytorch-fid ignores). train/fid_stats.py also stores the dataset's spec
and image shape (keys `dataset`, `image_shape`, ignored by pytorch-fid too): FID against statistics
of other data or another image size warns, as do statistics with a (near) zero covariance.
ADM's batches (eqxdiff/eval/adm_batches.py) serve as references too: a reference batch by its stored
`mu`/`sigma`, a batch of images alone by statistics computed from them once (open_fid).
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass
import os
import tempfile
import warnings
import zipfile
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import Float

from eqxdiff.eval.adm_batches import IMAGES, array_names, image_batches
from eqxdiff.eval.adm_batches import image_shape as batch_image_shape
from eqxdiff.eval.feature_stats import FeatureStats, gather_feature_stats, load_stats
from eqxdiff.eval.frechet import _trace_sqrt, fid_from_stats
from eqxdiff.eval.inception import TORCH_LAYOUTS, InceptionV3, check_weights_file, skipped_keys
from eqxdiff.eval.precision_recall import precision_recall
from eqxdiff.local_copies import local_copy, upload
from eqxdiff.nn.abstract_network import abstract_network
from eqxdiff.nn.torch_weights import load_safetensors
from eqxdiff.paths import as_path, is_url
from eqxdiff.sharding import batch_sharding, make_mesh, placement

FEATURES_KEY = "features"  # the reference file's kept feature rows [n, d] float32, in random order
DATA_KEYS = ("dataset", "image_shape")  # what the statistics are of: a str, int64 [3] (train/fid_stats.py)
NEIGHBOURS = 3  # precision/recall's k (the paper's)


@eqx.filter_jit
def rgb_features(features_fn, images):
    """uint8 [b, h, w, 1 or 3] -> the network's features [b, d]; grayscale repeated to RGB on device
    (as pytorch-fid converts every image to RGB)."""
    if images.shape[-1] == 1:
        images = jnp.repeat(images, 3, axis=-1)
    return features_fn(images)


def replicated(features_fn: Any, mesh) -> Any:
    """`features_fn` with its arrays (a network's weights) on every device of `mesh`."""
    arrays, static = eqx.partition(features_fn, eqx.is_array)
    return eqx.combine(jax.device_put(arrays, NamedSharding(mesh, P())), static)


def feature_dim(features_fn: Any, image_shape: tuple[int, int, int], batch: int = 2) -> int:
    """The dimension of `features_fn`'s features of uint8 images `image_shape` (traced, not run);
    an error unless it maps a batch to one feature row per image."""
    out = eqx.filter_eval_shape(rgb_features, features_fn, jax.ShapeDtypeStruct((batch, *image_shape), np.uint8))
    if len(out.shape) != 2 or out.shape[0] != batch:
        raise ValueError(f"features_fn maps {batch} images to {out.shape}; it must give one feature row per image.")
    return int(out.shape[1])


def chunk_seed(seed: int, start: int) -> int:
    """The sampling seed of the chunk of samples that starts at row `start`: chunks of one seed, and
    runs of different seeds, draw independent noise (seed + start would share chunks across seeds)."""
    return int(np.random.SeedSequence([seed, start]).generate_state(1)[0])


@dataclass(frozen=True)
class FIDReference:
    """A dataset's FID statistics (float64 mu [d], sigma [d, d]) and, if the file keeps them, a random
    subset of its feature rows (float32 [n, d], in random order) for precision and recall, the
    dataset's spec and its images' [h, w, c] (None where the file does not say)."""

    mu: np.ndarray
    sigma: np.ndarray
    features: np.ndarray | None
    path: str
    dataset: str | None = None
    image_shape: tuple[int, ...] | None = None


def warn_if_degenerate(mu: Float[np.ndarray, " d"], sigma: Float[np.ndarray, "d d"], what: str) -> None:
    """Warn when the covariance is (near) zero, total variance tr(sigma) <= 1e-6 ‖mu‖²: the statistics are
    of (almost) one image repeated, and FID against them measures the distance to that image alone."""
    total, size = float(np.trace(sigma)), float(mu @ mu)
    if total <= 1e-6 * max(size, 1e-12 * len(mu)):
        warnings.warn(
            f"{what}: the features' covariance is (near) zero (total variance {total:.3g} against "
            f"{size:.3g} for the squared mean): the images are (almost) all the same, so an FID against "
            "these statistics means little.",
            UserWarning,
            stacklevel=3,
        )


def data_name(spec: str) -> str:
    """A dataset spec as compared across machines: its kind and the last part of its path (a glob: the
    folder holding the files), e.g. folder:~/data/pets/ and folder:/mnt/pets -> folder:pets."""
    kind, _, arg = spec.partition(":")
    path = Path(arg.rstrip("/"))
    while path.name and any(c in path.name for c in "*?["):
        path = path.parent
    return f"{kind}:{path.name}" if arg else spec


def warn_if_other_data(reference: FIDReference, image_shape: tuple[int, ...], dataset: str | None) -> None:
    """Warn when `reference` says it holds statistics of images of another [h, w, c] than `image_shape`
    (pytorch-fid resizes both to 299², but at other sizes the same data give other features) or of
    another dataset than `dataset` (compared by `data_name`)."""
    if reference.image_shape is not None and tuple(reference.image_shape) != tuple(image_shape):
        shapes = "×".join(map(str, reference.image_shape)), "×".join(map(str, image_shape))
        warnings.warn(
            f"{reference.path} holds statistics of {shapes[0]} images, the samples are {shapes[1]}: an FID "
            "between them measures the size as much as the model; write statistics at the samples' size "
            "(train/fid_stats.py --image_size).",
            UserWarning,
            stacklevel=3,
        )
    if reference.dataset is not None and dataset is not None and data_name(reference.dataset) != data_name(dataset):
        warnings.warn(
            f"{reference.path} holds statistics of {reference.dataset}, the model trained on {dataset}: "
            "an FID against another dataset means little.",
            UserWarning,
            stacklevel=3,
        )


def load_reference(path: str | Path, dim: int | None = None) -> FIDReference:
    """A statistics .npz (train/fid_stats.py's, or pytorch-fid's --save-stats) with its kept
    `features` if it has them; `dim`: the feature network's dimension (2048 for InceptionV3), an
    error if the file's differs. A URL is read from its local copy (eqxdiff.local_copies)."""
    path = local_copy(path)
    mu, sigma = load_stats(path, dim)
    with np.load(path, allow_pickle=False) as f:
        features = np.asarray(f[FEATURES_KEY], np.float32) if FEATURES_KEY in f.files else None
        about = {k: f[k] for k in DATA_KEYS if k in f.files}
        adm = "mu_s" in f.files  # ADM's reference batch: statistics of its TF graph
    if features is not None:
        if features.ndim != 2 or features.shape[1] != len(mu) or len(features) <= NEIGHBOURS:
            raise ValueError(
                f"{path}: '{FEATURES_KEY}' has shape {features.shape}; it must hold more than {NEIGHBOURS} rows of "
                f"{len(mu)}-dimensional features (rewrite it with train/fid_stats.py --keep_features N)."
            )
        if not np.isfinite(features).all():
            raise ValueError(f"{path}: '{FEATURES_KEY}' holds NaN/inf values.")
    warn_if_degenerate(mu, sigma, str(path))
    if adm:
        warnings.warn(
            f"{path} is ADM's reference batch: its mu/sigma come from the TF graph, whose resize and "
            "scaling are not pytorch-fid's (used here), so FID against them is offset a little; "
            "train/evaluate.py reports both ADM's way.",
            UserWarning,
            stacklevel=2,
        )
    dataset = str(about["dataset"]) if "dataset" in about else None
    image_shape = tuple(int(n) for n in about["image_shape"]) if "image_shape" in about else None
    return FIDReference(mu, sigma, features, str(path), dataset, image_shape)


def save_reference(
    path: str | os.PathLike,
    mu: Float[np.ndarray, " d"],
    sigma: Float[np.ndarray, "d d"],
    features: Float[np.ndarray, "n d"] | None = None,
    *,
    dataset: str | None = None,
    image_shape: tuple[int, ...] | None = None,
) -> None:
    """pytorch-fid's statistics file (float64 `mu`, `sigma`) plus what pytorch-fid never reads: kept
    feature rows (float32 `features`), the dataset's spec and its images' [h, w, c] (`DATA_KEYS`);
    eqxdiff.eval.save_stats writes one without them. A URL's file is written locally, then uploaded."""
    path = as_path(path)
    if path.suffix != ".npz":
        raise ValueError(f"{path}: name statistics files *.npz; pytorch-fid reads a path as statistics only then.")
    d = len(mu)
    if np.shape(sigma) != (d, d) or (features is not None and (np.ndim(features) != 2 or np.shape(features)[1] != d)):
        raise ValueError(
            f"{path}: mu {np.shape(mu)}, sigma {np.shape(sigma)}, features {np.shape(features)}; "
            "they must be [d], [d, d] and [n, d]."
        )
    if is_url(path):
        with tempfile.TemporaryDirectory() as folder:
            local = Path(folder) / path.name
            save_reference(local, mu, sigma, features, dataset=dataset, image_shape=image_shape)
            upload(local, path)  # one object: whole or not at all
        return
    tmp = path.with_name(path.name + ".tmp")  # whole or not at all: a rename
    with open(tmp, "wb") as f:  # a file object: np.savez would append .npz to a path
        arrays = {"mu": np.asarray(mu, np.float64), "sigma": np.asarray(sigma, np.float64)}
        if features is not None:
            arrays[FEATURES_KEY] = np.asarray(features, np.float32)
        if dataset is not None:
            arrays["dataset"] = np.asarray(dataset, dtype=str)  # a unicode array: read without pickle
        if image_shape is not None:
            arrays["image_shape"] = np.asarray(image_shape, np.int64)
        np.savez_compressed(f, **arrays)
    tmp.replace(path)


class KeptFeatures:
    """`num` rows of a stream of `total` feature vectors, a uniform random subset chosen before the
    stream starts: every process keeps the chosen rows it sees (`update(features, start)`, rows
    start.. of the stream) and `gather()` joins them across processes, in a random order (so
    any first n of them are a random subset too)."""

    def __init__(self, total: int, num: int, dim: int, seed: int = 0):
        if not 0 < num <= total:
            raise ValueError(f"Cannot keep {num} of {total} feature vectors; keep between 1 and {total}.")
        rng = np.random.default_rng(seed)
        self.indices = np.sort(rng.choice(total, num, replace=False))
        self.order = rng.permutation(num)
        self.rows = np.zeros((num, dim), np.float32)
        self.seen = np.zeros(num, np.int32)

    def update(self, features: Float[np.ndarray, "b d"], start: int) -> "KeptFeatures":
        """Keep the chosen ones of rows start .. start + b of the stream. Returns self."""
        lo, hi = np.searchsorted(self.indices, (start, start + len(features)))
        self.rows[lo:hi] = features[self.indices[lo:hi] - start]
        self.seen[lo:hi] += 1
        return self

    def gather(self) -> Float[np.ndarray, "n d"]:
        """Every chosen row, joined across processes (a collective: all processes call it; each
        row comes from the one process that saw it, the others send zeros), in random order."""
        rows, seen = self.rows, self.seen
        if jax.process_count() > 1:
            g = multihost_utils.process_allgather({"rows": rows, "seen": seen})  # float32: exact on devices
            rows, seen = g["rows"].sum(axis=0), g["seen"].sum(axis=0)
        if (seen != 1).any():
            raise RuntimeError(
                f"{np.count_nonzero(seen != 1)} of the {len(seen)} kept rows were seen {sorted(set(seen.tolist()))} "
                "times, not once: the stream must pass each of its rows once, to one process."
            )
        return rows[self.order]


def frechet_distance_of_few(
    x: Float[np.ndarray, "n d"], mu: Float[np.ndarray, " d"], sigma: Float[np.ndarray, "d d"]
) -> float:
    """The Fréchet distance (frechet_distance's value) between N(mean, cov) of n <= d feature rows
    `x` and N(mu, sigma), computed with n × n matrices: cov = YᵀY / (n - 1) for the centred rows Y,
    and the nonzero eigenvalues of sigma·cov, whose square roots sum to tr((sigma cov)^½), are
    those of the n × n PSD matrix Y sigma Yᵀ / (n - 1) (AB and BA share them). O(n d²) work
    instead of eigendecompositions of d × d matrices (O(d³), the slow part at d = 2048)."""
    x = np.asarray(x, np.float64)
    n, mean = len(x), x.mean(axis=0)
    y, diff = x - mean, mean - mu
    lam = np.linalg.eigvalsh(y @ np.asarray(sigma, np.float64) @ y.T / (n - 1))
    fd = diff @ diff + (y * y).sum() / (n - 1) + np.trace(sigma) - 2.0 * _trace_sqrt(lam)
    return float(max(fd, 0.0))  # as frechet_distance: identical sets give ±round-off


def fid_of_samples(
    sample_chunk: Callable[[int, int], np.ndarray],
    num: int,
    features_fn: Any,
    reference: FIDReference,
    *,
    chunk_size: int,
    seed: int = 0,
) -> dict[str, float | int]:
    """FID of `num` samples against `reference`, and precision/recall (k = 3) when it keeps features.

    `sample_chunk(start, size)` -> uint8 images [size, h, w, 1 or 3] (rows start .. start + size of
    the samples): called for consecutive chunks of `chunk_size` rows by every process alike, each
    getting all of a chunk's rows (as eqxdiff.generate.generate gives them). `features_fn`: uint8
    RGB [b, h, w, 3] -> float32 [b, d], e.g. InceptionV3; replicated over this process's devices.

    Returns {"num", "fid", and with reference features "precision", "recall"} on every process.
    The samples' FID is pytorch-fid's (fid_from_stats) when num > d. With fewer samples than
    dimensions their covariance is singular and pytorch-fid would run scipy's sqrtm to decide on its
    eps offset (a d × d Schur decomposition); the exact distance is taken instead, from all the features kept
    (frechet_distance_of_few: n × n matrices), which differs from pytorch-fid's only where its sqrtm
    fails (~1e-3 relative). Precision/recall compare min(num, kept) rows of each side: a uniform
    random subset of the samples (seeded by `seed`).
    """
    return fids_of_samples(sample_chunk, num, [(features_fn, reference)], chunk_size=chunk_size, seed=seed)[0]


def fids_of_samples(
    sample_chunk: Callable[[int, int], np.ndarray],
    num: int,
    measures: Sequence[tuple[Any, FIDReference]],
    *,
    chunk_size: int,
    seed: int = 0,
) -> list[dict[str, float | int]]:
    """`fid_of_samples` of each (feature network, reference) of `measures` (FID's and FD-DINOv2's) over the same
    samples, made once: each chunk goes through every network as it comes. A result per measure, in order."""
    if num < 2 or chunk_size < 1:
        raise ValueError(f"FID needs num >= 2 samples and chunk_size >= 1, got num {num}, chunk_size {chunk_size}.")
    p, processes = jax.process_index(), jax.process_count()
    devices = jax.local_devices()
    mesh = make_mesh(devices=devices)
    per_device = -(-chunk_size // (processes * len(devices)))  # this process's share of a chunk, padded
    local_batch = per_device * len(devices)  # ... to one shape over its devices: one compile
    streams = [_FeatureStream(replicated(fn, mesh), reference, num, seed) for fn, reference in measures]
    for start in range(0, num, chunk_size):
        size = min(chunk_size, num - start)
        images = np.asarray(sample_chunk(start, size))
        if images.dtype != np.uint8 or images.ndim != 4 or len(images) != size:
            raise ValueError(
                f"sample_chunk({start}, {size}) gave {images.dtype} {images.shape}; "
                f"FID takes uint8 [{size}, h, w, 1 or 3]."
            )
        lo, hi = p * size // processes, (p + 1) * size // processes  # this process's rows of the chunk
        if hi > lo:
            mine = images[lo:hi]
            padded = jax.device_put(
                np.concatenate([mine, np.repeat(mine[-1:], local_batch - len(mine), axis=0)]), batch_sharding(mesh)
            )
            for stream in streams:
                stream.update(np.asarray(rgb_features(stream.features_fn, padded))[: len(mine)], start + lo)
    return [stream.result() for stream in streams]


class _FeatureStream:
    """One feature network's share of `fids_of_samples`: the samples' statistics (or, fewer samples than
    dimensions, every feature row) and the rows precision/recall keep, then the distance to `reference`."""

    def __init__(self, features_fn: Any, reference: FIDReference, num: int, seed: int):
        self.features_fn, self.reference, self.num = features_fn, reference, num
        dim = len(reference.mu)
        self.few = num <= dim  # a singular covariance: the distance from all the features (frechet_distance_of_few)
        self.stats = None if self.few else FeatureStats(dim)
        self.every = KeptFeatures(num, num, dim) if self.few else None
        self.kept_num = 0 if reference.features is None else min(num, len(reference.features))
        self.kept = KeptFeatures(num, self.kept_num, dim, seed) if self.kept_num > NEIGHBOURS else None  # k-NN: k + 1

    def update(self, features: np.ndarray, first_row: int) -> None:
        if self.stats is not None:
            self.stats.update(features)
        for rows in (self.every, self.kept):
            if rows is not None:
                rows.update(features, first_row)

    def result(self) -> dict[str, float | int]:
        ref = self.reference
        if self.few:
            fid = frechet_distance_of_few(self.every.gather(), ref.mu, ref.sigma)
        else:
            fid = fid_from_stats(*gather_feature_stats(self.stats).mean_cov(), ref.mu, ref.sigma)
        result = {"num": self.num, "fid": fid}
        if self.kept is not None:
            fake = self.kept.gather()
            result["precision"], result["recall"] = precision_recall(ref.features[: self.kept_num], fake, NEIGHBOURS)
        return result


def load_inception(path: str | Path) -> InceptionV3:
    """InceptionV3.from_pytorch_fid(path); in a job of several processes, with its weights on this
    process's first device: from_pytorch_fid puts them on jax.devices()[0], which only process 0
    can address. A URL is read from its local copy (eqxdiff.local_copies)."""
    path = local_copy(path)
    if jax.process_count() == 1:
        return InceptionV3.from_pytorch_fid(path)
    check_weights_file(path)
    abstract = abstract_network(InceptionV3)
    local = make_mesh(devices=jax.local_devices()[:1])
    ignore = skipped_keys(abstract)
    return load_safetensors(abstract, path, ignore=ignore, place=placement(local), layouts=TORCH_LAYOUTS)


def reference_of_images(path: str | Path, features_fn: Any, batch_size: int = 256) -> FIDReference:
    """The FID reference of a batch file's images (`arr_0`, uint8 [n, h, w, 1 or 3]: ADM's batch
    layout) by `features_fn`: their statistics and every feature row (precision/recall; ADM's reference
    batches hold 10,000), computed once, `batch_size` at a time over this process's devices (every
    process computes all of it, the same)."""
    path = local_copy(path)
    shape = batch_image_shape(path)
    devices = jax.local_devices()
    mesh = make_mesh(devices=devices)
    features_fn = replicated(features_fn, mesh)
    size = -(-batch_size // len(devices)) * len(devices)
    stats, rows = FeatureStats(feature_dim(features_fn, shape[1:])), []
    for images in image_batches(path, size):
        padded = np.concatenate([images, np.repeat(images[-1:], size - len(images), axis=0)])
        rows.append(np.asarray(rgb_features(features_fn, jax.device_put(padded, batch_sharding(mesh))))[: len(images)])
        stats.update(rows[-1])
    mu, sigma = stats.mean_cov()
    warn_if_degenerate(mu, sigma, str(path))
    features = np.concatenate(rows) if stats.count > NEIGHBOURS else None
    return FIDReference(mu, sigma, features, str(path), None, tuple(shape[1:]))


def stored_dim(path: str | Path) -> int | None:
    """The dimension of the statistics `mu` an .npz stores (its shape read from the header), None if it has none."""
    path = local_copy(path)
    if not (path.is_file() and zipfile.is_zipfile(path)) or "mu" not in array_names(path):
        return None
    with np.load(path, allow_pickle=False, mmap_mode="r") as f:
        return int(f["mu"].shape[0]) if f["mu"].ndim == 1 else None


def is_image_batch(path: str | Path) -> bool:
    """Whether `path` is an .npz of images without statistics: `arr_0` and no `mu` (ADM's sample-batch
    layout; a reference batch that stores `mu`/`sigma` reads as statistics)."""
    path = local_copy(path)
    if not (path.is_file() and zipfile.is_zipfile(path)):
        return False
    names = array_names(path)
    return IMAGES in names and "mu" not in names


def open_fid(
    inception: str | Path,
    reference: str | Path,
    image_shape: tuple[int, ...],
    features_fn: Any = None,
    dataset: str | None = None,
) -> tuple[Any, FIDReference]:
    """(feature network, reference) for FID of images `image_shape`, checked against each other
    before anything is sampled: InceptionV3 from pytorch-fid's weights (`inception`: its .pth, or a
    .safetensors copy), or `features_fn` (a stand-in, for tests), and the statistics file `reference` (its
    dimension must be the network's: 2048 for InceptionV3; ADM's reference batch reads as its stored
    `mu`/`sigma`), or a batch of images `arr_0` without statistics (ADM's layout) or with another network's
    (FD-DINOv2 against ADM's reference batch), whose statistics and features are computed here once. Errors are ValueError/FileNotFoundError
    naming the file and the fix; statistics of (almost) one image, of another image size or of
    another dataset than `dataset` (the model's training data) warn."""
    if features_fn is None:
        if not str(inception):
            raise ValueError(
                "FID needs the Inception weights: pass --inception "
                "pt_inception-2015-12-05-6726825d.pth (pytorch-fid's FID weights)."
            )
        features_fn = load_inception(inception)
    if not str(reference):
        raise ValueError("FID needs the dataset's statistics: write them with train/fid_stats.py --out FILE.npz.")
    dim = feature_dim(features_fn, image_shape)
    path = local_copy(reference)
    with_images = path.is_file() and zipfile.is_zipfile(path) and IMAGES in array_names(path)
    if is_image_batch(reference) or (with_images and stored_dim(reference) != dim):
        # ADM's batch of images, or one whose stored statistics are another network's (its Inception statistics, for
        # FD-DINOv2): statistics of its images computed once, here
        loaded = reference_of_images(reference, features_fn)
    else:
        loaded = load_reference(reference, dim=dim)
    warn_if_other_data(loaded, image_shape, dataset)
    return features_fn, loaded
