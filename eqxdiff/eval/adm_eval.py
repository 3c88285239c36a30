"""ADM's evaluation (openai/guided-diffusion, evaluations/evaluator.py) of a sample batch against a
reference batch: Inception Score, FID, sFID, precision and recall, from ADMInception's features.

Each batch file's images go through the network once, `batch_size` at a time split over this process's
devices (the weights replicated), read from the file as they go: pool3 rows are kept (precision and
recall compare feature vectors, as ADM keeps them), spatial features are summed into their float64
statistics (FeatureStats: np.mean / np.cov's values, ADM's compute_statistics), logits are kept for the
Inception Score. FID and sFID are eqxdiff.eval.fid_from_stats: the math of ADM's
FIDStatistics.frechet_distance (both are TTUR's, as pytorch-fid's). Precision and recall are
eqxdiff.eval.precision_recall (k = 3, Kynkäänniemi et al. 2019), ADM's ManifoldEstimator's math with
its distances in float64, where ADM computes them in float16 (float32 where float16 overflows): the
two differ only for a point within float16 round-off of a ball's radius.
"""

from dataclasses import dataclass
from pathlib import Path

import equinox as eqx
import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from eqxdiff.eval.adm_batches import image_batches, image_shape
from eqxdiff.eval.adm_inception import SPATIAL_DIM, ADMInception
from eqxdiff.eval.feature_stats import FeatureStats
from eqxdiff.eval.frechet import fid_from_stats
from eqxdiff.eval.inception_score import inception_score
from eqxdiff.eval.precision_recall import precision_recall
from eqxdiff.sharding import batch_sharding, make_mesh

NEIGHBOURS = 3  # ADM's ManifoldEstimator(nhood_sizes=(3,))


@dataclass
class BatchFeatures:
    """One batch file's features: pool3 rows float32 [n, 2048], logits float32 [n, 1008], and the
    float64 statistics (mu, sigma) of pool3 and of the spatial features [2023]."""

    pool3: np.ndarray
    logits: np.ndarray
    stats: dict[str, tuple[np.ndarray, np.ndarray]]


@eqx.filter_jit
def _features(network: ADMInception, images):
    if images.shape[-1] == 1:  # grayscale as RGB, as pytorch-fid converts every image
        images = images.repeat(3, axis=-1)
    return network(images)


def batch_features(network: ADMInception, path: str | Path, batch_size: int, progress=None) -> BatchFeatures:
    """The features of the images `arr_0` of the batch file `path`, `batch_size` (rounded up to a
    multiple of the local device count) at a time over this process's devices; `progress(rows)` after
    each batch."""
    devices = jax.local_devices()
    mesh = make_mesh(devices=devices)
    arrays, static = eqx.partition(network, eqx.is_array)
    network = eqx.combine(jax.device_put(arrays, NamedSharding(mesh, P())), static)
    size = -(-batch_size // len(devices)) * len(devices)  # one shape: one compile
    n = image_shape(path)[0]
    pool3, logits = np.empty((n, 2048), np.float32), np.empty((n, 1008), np.float32)
    stats = {"pool3": FeatureStats(2048), "spatial": FeatureStats(SPATIAL_DIM)}
    done, pending = 0, None

    def collect(outputs, rows: int) -> None:
        nonlocal done
        p, s, z = (np.asarray(o)[:rows] for o in outputs)
        pool3[done : done + rows], logits[done : done + rows] = p, z
        stats["pool3"].update(p)
        stats["spatial"].update(s)
        done += rows
        if progress is not None:
            progress(rows)

    for images in image_batches(path, size):
        padded = np.concatenate([images, np.repeat(images[-1:], size - len(images), axis=0)])
        outputs = _features(network, jax.device_put(padded, batch_sharding(mesh)))  # runs while the last is read
        if pending is not None:
            collect(*pending)
        pending = (outputs, len(images))
    collect(*pending)
    return BatchFeatures(pool3, logits, {k: v.mean_cov() for k, v in stats.items()})


def adm_metrics(
    samples: BatchFeatures,
    reference: BatchFeatures | None,
    stored: dict[str, tuple[np.ndarray, np.ndarray]],
) -> dict[str, float]:
    """ADM's table: "inception_score" of the samples; "fid"/"sfid" against the reference batch's
    `stored` statistics ("fid_stored", "sfid_stored": ADM's, from the TF graph) and against the
    statistics of its images' features from this network ("fid_recomputed", "sfid_recomputed");
    "precision", "recall" against the reference's pool3 rows. Entries whose inputs are missing (a
    reference without images, or without stored statistics) are left out."""
    out = {"inception_score": inception_score(samples.logits)}
    for metric, which in (("fid", "pool3"), ("sfid", "spatial")):
        if which in stored:
            out[f"{metric}_stored"] = fid_from_stats(*samples.stats[which], *stored[which])
        if reference is not None:
            out[f"{metric}_recomputed"] = fid_from_stats(*samples.stats[which], *reference.stats[which])
    if reference is not None:
        out["precision"], out["recall"] = precision_recall(reference.pool3, samples.pool3, NEIGHBOURS)
    return out
